"""The benchmarks' own questions: held out from every training prompt (tests/unit/test_prompts.py checks that no
question, nor its topic, is among train/prompts.py's), so acceptance measured on them is not measured on training
data."""

HELDOUT = [
    "What is the capital of France?", "How do airplanes stay in the air?", "Write a limerick about a cat.",
    "What are the benefits of drinking water?", "Explain how a refrigerator keeps food cold.",
    "Give me a recipe for pancakes.", "What causes the northern lights?", "Write a thank-you note to a teacher.",
    "How can I improve my handwriting?", "What is the difference between weather and climate?",
    "Describe a sunset over the sea.", "Why do leaves change color in autumn?",
    "Write a Python function that checks whether a year is a leap year.",
    "How do I make a good first impression?", "What is a volcano made of?",
    "Suggest a name for a bakery and explain why.", "What is the tallest animal in the world?",
    "Explain what an API is.", "Write two sentences about the importance of reading.",
    "How does a compass work?", "What are some fun things to do on a rainy day?",
    "Tell me about the planet Jupiter.", "How do I boil an egg?", "What is the purpose of a museum?",
]


def heldout_prompts() -> list[str]:
    return list(HELDOUT)
