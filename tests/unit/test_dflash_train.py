"""`specserve train dflash`: the block attention rule, labels and anchors, batched blocks that equal the server's
one-block forward, and a smoke run on a tiny random target (loss falls, held-out tau and accuracy beat the
untrained drafter, the export loads with its d2t)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.engine.model.vocab_map import save_vocab_map
from specserve.engine.spec_decode.dflash.model import DFlashDrafter, block_masks, load_drafter, new_config
from specserve.train.cli import add_train_parser
from specserve.train.dflash import (
    IGNORE,
    Frozen,
    Sequence,
    block_targets,
    choose_mask_token,
    context_layer_ids,
    default_gamma,
    draft_hidden,
    draw_anchors,
    init_from_target,
    make_batch,
    train_dflash,
    training_mask,
)
from specserve.train.loop import TrainConfig
from tests.tiny_models import build_word_tokenizer

VOCAB = 300
CYCLE = list(range(20, 32))  # answers walk this cycle: the token k places on is a function of the current one


def test_training_mask_follows_the_rules_entry_by_entry():
    anchors, b, t = [2, 5], 3, 8
    ctx_visible, same_block = training_mask(anchors, b, t)
    assert ctx_visible.shape == (6, 8) and same_block.shape == (6, 6)
    for q in range(6):
        anchor = anchors[q // b]
        for p in range(t):  # context keys strictly before the query's own anchor
            assert bool(ctx_visible[q, p]) == (p < anchor), (q, p)
        for r in range(6):  # its own block, bidirectionally; never the other block
            assert bool(same_block[q, r]) == (q // b == r // b), (q, r)
    assert ctx_visible.int().tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 0, 0, 0]] * 3


def test_block_targets_shift_by_k_and_decay():
    labels = torch.tensor([IGNORE, IGNORE, 10, 11, 12, 13])  # prompt of 2, answer of 4
    lab, w = block_targets([1, 4], 3, labels, gamma=4.0)
    assert lab.tolist() == [IGNORE, 10, 11, IGNORE, 13, IGNORE]  # position 0 never; past the end ignored
    expected = [0.0, 1.0, torch.exp(torch.tensor(-0.25)).item(), 0.0, 1.0, 0.0]
    assert torch.allclose(w, torch.tensor(expected))
    assert default_gamma(8) == 4.0 and default_gamma(16) == 7.0


def test_anchors_are_distinct_and_inside_the_answer():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = draw_anchors(n_prompt=5, n=12, count=4, generator=g)
        assert len(a) == len(set(a)) == 4 and all(4 <= x <= 10 for x in a) and a == sorted(a)
    assert draw_anchors(5, 7, 16, g) == [4, 5]  # fewer candidates than asked: all of them


def test_mask_token_and_layer_choices():
    assert choose_mask_token([0, 7, 9], used={9, 1, 2}, vocab_size=10) == 7  # highest special id not in the data
    assert choose_mask_token([0], used={0, 9}, vocab_size=10) == 8  # else the highest unused id
    assert context_layer_ids(12, 2) == [1, 9]
    assert context_layer_ids(12, 2, num_context_layers=3) == [1, 5, 9]
    assert context_layer_ids(12, 2, layer_ids=[3, 4]) == [3, 4]
    with pytest.raises(ValueError, match="target_layer_ids"):
        context_layer_ids(4, 1, layer_ids=[4])


def _tiny_target_config(layers: int = 4) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_batched_blocks_equal_the_servers_one_block_forward():
    """Two sequences, three blocks, one padded block and padded context: every real block's hidden states equal
    a forward of that block alone with exactly the context before its anchor (what the server runs)."""
    torch.manual_seed(0)
    tcfg = _tiny_target_config()
    drafter = DFlashDrafter(new_config(tcfg, 2, 4, mask_token_id=299, target_layer_ids=[1, 2])).eval()
    frozen = Frozen(torch.nn.Embedding(VOCAB, 64), torch.randn(VOCAB, 64), None)
    seqs = [Sequence(torch.randint(0, 200, (n,)), 3, torch.full((n,), IGNORE), torch.randn(n, 128))
            for n in (12, 9)]
    anchors = [[3, 7], [5]]
    batch = make_batch(seqs, anchors, 4, 299, 4.0)
    assert batch.real.tolist() == [[True, True], [True, False]]
    with torch.no_grad():
        hidden = draft_hidden(drafter, frozen, batch)  # [2, 8, 64]
        for s, anc in enumerate(anchors):
            for i, a in enumerate(anc):
                one = make_batch([seqs[s]], [[a]], 4, 299, 4.0)
                assert one.ctx_visible.all()  # the whole (truncated) context, as the server's
                alone = draft_hidden(drafter, frozen, one)[0]  # [4, 64]
                torch.testing.assert_close(hidden[s, i * 4:(i + 1) * 4], alone, atol=1e-5, rtol=1e-5)
    masks = block_masks(drafter, batch.ctx_visible, batch.q_pos, torch.cat([batch.ctx_pos, batch.q_pos], 1),
                        batch.same_block)
    assert all(m.any(-1).all() for m in masks)  # no all-masked query row, padding included


def test_init_from_target_copies_layers_and_final_norm():
    torch.manual_seed(0)
    target = LlamaForCausalLM(_tiny_target_config())
    with torch.no_grad():
        for p in target.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from 1
    drafter = DFlashDrafter(new_config(target.config, 2, 4, mask_token_id=299))
    init_from_target(drafter, target, [3, 1])
    src, dst = target.model.layers[1], drafter.layers[1]
    for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"):
        assert torch.equal(dst.state_dict()[name], src.state_dict()[name]), name
    assert torch.equal(dst.self_attn.q_norm.weight, torch.ones(16))
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    with pytest.raises(ValueError, match="init_layers"):
        init_from_target(drafter, target, [1])


def _records(n: int = 40) -> list[dict]:
    """selfgen-style records: a random prompt, then an answer that walks CYCLE from a random point; the target's
    argmax is the answer itself (greedy), its other top-k ids are noise."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        start = int(torch.randint(0, len(CYCLE), (1,), generator=g))
        answer = [CYCLE[(start + j) % len(CYCLE)] for j in range(24)]
        top = torch.randint(40, 200, (24, 20), generator=g)
        top[:, 0] = torch.tensor(answer)
        out.append({"index": i, "prompt_index": i, "prompt_ids": torch.randint(40, 200, (6,), generator=g),
                    "output_ids": torch.tensor(answer), "top_ids": top})
    return out


def test_training_lowers_the_loss_and_beats_the_untrained_drafter(tmp_path):
    torch.manual_seed(0)
    target = LlamaForCausalLM(_tiny_target_config(layers=6))
    with torch.no_grad():  # random init is nearly uniform: widen the logits so a right answer can be confident
        target.lm_head.weight.mul_(8.0)
    target.save_pretrained(tmp_path / "target")
    build_word_tokenizer(tmp_path / "target", VOCAB)  # its only special token is id 299 (EOS)
    data = tmp_path / "data"
    data.mkdir()
    torch.save(_records(), data / "shard_00000.pt")
    save_vocab_map(tmp_path, torch.arange(150))
    cfg = TrainConfig(steps=40, batch_size=4, lr=3e-3, warmup_steps=5, ckpt_dir=str(tmp_path / "ckpt"),
                      log_every=20, threads=1, eval_batches=2)
    out = tmp_path / "drafter"
    report = train_dflash(str(tmp_path / "target"), data, out, cfg, num_layers=1, block_size=4,
                          num_context_layers=2, num_anchors=8, vocab_map=str(tmp_path / "vocab_map.safetensors"),
                          init_layers=[2])
    assert report["last_train_loss"] < 0.7 * report["first_train_loss"]
    assert report["tau"] > report["tau_untrained"] + 0.3
    assert report["accuracy_by_position"][0] > report["accuracy_by_position_untrained"][0]
    assert report["drafter"]["mask_token_id"] == 299 and report["drafter"]["target_layer_ids"] == [1, 3]
    assert report["draft_vocab"] == 150 and report["heldout_label_coverage"] == 1.0
    assert json.loads((out / "train_summary.json").read_text())["tau"] == report["tau"]
    drafter, d2t = load_drafter(out, torch.float32, torch.device("cpu"))
    assert torch.equal(d2t, torch.arange(150))
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (4, 299, [1, 3])
    cfg.steps = 42  # resumable: continues from the checkpoint (and the cached features)
    assert train_dflash(str(tmp_path / "target"), data, out, cfg, num_layers=1, block_size=4,
                        num_context_layers=2, num_anchors=8, init_layers=[2],
                        vocab_map=str(tmp_path))["steps"] == 42
    # continuing from the export: its shape, context layers and vocabulary, and (up to its bf16 rounding) its
    # held-out accuracy to start from
    cfg2 = TrainConfig(steps=1, batch_size=4, lr=1e-9, warmup_steps=1, ckpt_dir=str(tmp_path / "ckpt2"),
                       log_every=20, threads=1, eval_batches=2)
    cont = train_dflash(str(tmp_path / "target"), data, tmp_path / "again", cfg2, num_layers=2, block_size=8,
                        init_drafter=str(out))
    assert cont["drafter"]["target_layer_ids"] == [1, 3] and cont["drafter"]["block_size"] == 4
    assert cont["draft_vocab"] == 150
    assert cont["tau_untrained"] > report["tau_untrained"] + 1.5 and cont["drafter"]["init"] == str(out)


def test_the_engine_accepts_a_trained_drafter_and_stays_greedy_exact(tiny, tmp_path):
    """Training and serving agree on positions, masks and target layers: the engine's DFlash proposer accepts most
    of a trained drafter's tokens on the answers it was trained on, and the output is the target's greedy one."""
    from specserve.engine.sampling_params import SamplingParams
    from tests.engine.helpers import make_core, run

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [f"def f{i}(x):" for i in range(16)]
    outs = run(make_core(tiny["llama"]), prompts, greedy)
    records = []
    for i, o in enumerate(outs):
        answer = torch.tensor(o.output_token_ids)
        top = torch.zeros(len(answer), 20, dtype=torch.long)
        top[:, 0] = answer
        records.append({"index": i, "prompt_index": i + 1, "prompt_ids": torch.tensor(o.prompt_token_ids),
                        "output_ids": answer, "top_ids": top})
    cfg = TrainConfig(steps=150, batch_size=8, lr=3e-3, warmup_steps=10, ckpt_dir=str(tmp_path / "ckpt"),
                      log_every=1000, threads=1, eval_batches=1)
    train_dflash(str(tiny["llama"]), records, tmp_path / "dflash", cfg, num_layers=1, block_size=4,
                 init_layers=[1], mask_token_id=tiny["vocab"] - 1)
    served = run(make_core(tiny["llama"], draft=tmp_path / "dflash", speculative_method="dflash", k=3), prompts,
                 greedy)
    assert [o.output_token_ids for o in served] == [o.output_token_ids for o in outs]
    accepted = sum(o.speculation.num_accepted_tokens for o in served)
    drafted = sum(o.speculation.num_draft_tokens for o in served)
    assert accepted > 0.4 * drafted


def test_cli_parses_dflash():
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "dflash", "--model", "m", "--data", "d", "--out", "o", "--num-context-layers",
                              "5", "--init-layers", "3,9", "--vocab-map", "v.safetensors"])
    assert (args.train_kind, args.target, args.num_layers, args.block_size, args.num_anchors) == \
        ("dflash", "m", 2, 8, 16)
    assert (args.num_context_layers, args.init_layers, args.vocab_map) == (5, "3,9", "v.safetensors")
