"""A fault in one request (non-finite logits, a tokenizer error) fails that request alone; the rest of the batch
finishes with exactly the greedy reference output (fp32), and every KV block comes back."""

import specserve.engine.core
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run

PROMPTS = ["The quick brown fox", "def main():", "café", "Speculative decoding", "x", "lazy dog"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def test_faulty_requests_fail_alone(tiny, monkeypatch):
    reference = [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS, GREEDY)]
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3)
    real_verify = specserve.engine.core.verify
    calls = {"n": 0}

    def verify_with_nan(logits, requests, ks, *args):
        calls["n"] += 1
        if calls["n"] == 3:  # poison request r1's rows in the third verification
            ids = [r.request_id for r in requests]
            if "r1" in ids:
                b = ids.index("r1")
                start = sum(k + 1 for k in ks[:b])
                logits = logits.clone()
                logits[start:start + ks[b] + 1] = float("nan")
        return real_verify(logits, requests, ks, *args)

    monkeypatch.setattr(specserve.engine.core, "verify", verify_with_nan)
    reqs = {f"r{i}": core.make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)}

    def broken(token_id):
        raise RuntimeError("tokenizer exploded")

    reqs["r4"].detokenizer.append = broken
    for r in reqs.values():
        core.add_request(r)
    final = {}
    for _ in range(500):
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        if len(final) == len(PROMPTS):
            break
    assert final["r1"].finish_reason == "error" and "non-finite" in final["r1"].error
    assert final["r4"].finish_reason == "error" and "tokenizer exploded" in final["r4"].error
    for i in (0, 2, 3, 5):
        assert final[f"r{i}"].output_token_ids == reference[i]
    assert core.allocator.usage == 0.0 and not core.has_unfinished()
