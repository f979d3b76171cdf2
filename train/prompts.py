"""Chat prompts built offline for self-distillation (self-instruct style: seed topics x instruction templates, plus
templates over local text). Deterministic for a given seed. The benchmarks' held-out questions live in
bench/prompts.py."""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

TOPICS = """photosynthesis; the water cycle; black holes; the French Revolution; the Roman Empire; volcanoes;
machine learning; neural networks; the stock market; inflation; climate change; renewable energy; solar panels;
electric cars; the human heart; the immune system; vaccines; DNA; evolution; dinosaurs; the Moon landing;
Mars exploration; the Internet; email; databases; cloud computing; encryption; passwords; recursion in programming;
sorting algorithms; binary search; linked lists; hash tables; the Python programming language; JavaScript; Linux;
version control with git; unit testing; healthy sleep; meditation; learning a new language; public speaking;
time management; job interviews; writing a resume; saving money; budgeting; cooking pasta; baking bread; coffee;
tea; chess; football; the Olympic Games; jazz music; classical music; the guitar; painting with watercolors;
photography; gardening; houseplants; dogs; cats; honeybees; whales; rainforests; deserts; the Sahara; mountains;
the ocean; earthquakes; hurricanes; electricity; magnets; gravity; the speed of light; atoms; the periodic table;
chemical reactions; the Pythagorean theorem; prime numbers; probability; statistics; fractions; the Renaissance;
Shakespeare; poetry; the printing press; the Industrial Revolution; World War II; ancient Egypt; the pyramids;
the Great Wall of China; democracy; the United Nations; recycling; plastic pollution; bicycles; trains; airplanes;
rockets; satellites; smartphones; video games; social media; friendship; kindness; motivation; habits; exercise;
running; yoga; nutrition; vitamins; the brain; memory; dreams; emotions; happiness; teamwork; leadership;
customer service; small businesses; marketing; negotiation; project planning; remote work; the history of money;
maps; the seasons; rainbows; clouds; snow; lightning; tides; coral reefs; bees and pollination""".split(";")

TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}?", "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.", "Why is {t} important?", "How does {t} work?",
    "Write a short story that involves {t}.", "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.", "Explain {t} to a five-year-old.",
    "Give me some tips about {t}.", "What are common misconceptions about {t}?",
    "Write a haiku about {t}.", "List five questions a student might ask about {t}.",
    "Describe {t} in one paragraph.", "What should a beginner know about {t}?",
    "Compare {t} with something from everyday life.", "Write a tweet about {t}.",
    "Can you tell me something surprising about {t}?", "How would you teach {t} to a friend?",
]

CODE_TASKS = """reverses a string; checks whether a number is prime; computes the factorial of n; returns the n-th
Fibonacci number; counts the vowels in a string; finds the largest element of a list; removes duplicates from a list;
checks whether a word is a palindrome; merges two sorted lists; converts Celsius to Fahrenheit; sums the digits of an
integer; flattens a nested list; counts word frequencies in a text; returns the GCD of two numbers; sorts a list of
dictionaries by a key; reads a file and prints its lines; validates an email address with a regular expression;
computes the average of a list; transposes a matrix; finds the second largest number in a list""".split(";")

CODE_TEMPLATES = ["Write a Python function that {t}.", "How do I write a function that {t} in Python?",
                  "Show me JavaScript code that {t}."]

TEXT_TEMPLATES = ["Summarize the following text:\n\n{x}", "Explain what this Python code does:\n\n{x}",
                  "Rewrite this text in plain English:\n\n{x}"]

PROMPT_SOURCES = {
    "topics": "seed topics x instruction templates (TOPICS x TEMPLATES)",
    "code": "small programming tasks x code templates (CODE_TASKS x CODE_TEMPLATES)",
    "stdlib": "400 docstrings and short functions of this Python's standard library (PSF License) under "
              "summarise / explain / rewrite templates",
}


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")  # lines with their ends, split as ast splits them


def _segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) (unpadded) from the source's lines; pure."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    return "".join([lines[first].encode()[node.col_offset:].decode(), *lines[first + 1:last],
                    lines[last].encode()[:node.end_col_offset].decode()])


def _stdlib_snippets(rng: random.Random, n: int, max_chars: int = 700) -> list[str]:
    """Docstrings and short functions of this Python's standard library (present on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    rng.shuffle(files)
    out: list[str] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = _LINE.findall(source)  # once per file: ast.get_source_segment splits the whole file per call
        for node in ast.walk(tree):
            if len(out) >= n:
                return out
            if isinstance(node, ast.FunctionDef):
                seg = _segment(lines, node)
                if 120 < len(seg) < max_chars:
                    out.append(seg)
            elif isinstance(node, ast.Module | ast.ClassDef):
                doc = ast.get_docstring(node) or ""
                if 200 < len(doc) < max_chars:
                    out.append(doc)
    return out


def training_prompts(seed: int = 0) -> list[str]:
    """Every training prompt, shuffled deterministically (none is a benchmark question: bench/prompts.py keeps
    those, and tests/unit/test_prompts.py checks the two sets stay apart)."""
    rng = random.Random(seed)
    prompts = [tpl.format(t=t.strip()) for t in TOPICS for tpl in TEMPLATES]
    prompts += [tpl.format(t=t.strip()) for t in CODE_TASKS for tpl in CODE_TEMPLATES]
    snippets = _stdlib_snippets(rng, 400)
    prompts += [rng.choice(TEXT_TEMPLATES).format(x=x) for x in snippets]
    prompts = list(dict.fromkeys(prompts))
    rng.shuffle(prompts)
    return prompts
