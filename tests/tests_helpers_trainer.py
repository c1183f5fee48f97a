"""Small texts for tokenizer tests."""

SMALL_CORPUS = [
    "<|start|>user<|message|>What is two plus two?<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Four.<|return|>",
    "Je réfléchis à la question, puis je réponds brièvement en français.",
    "Ich überlege kurz und antworte auf Deutsch, so klar wie möglich.",
    "Pienso en la pregunta y respondo en español de forma breve.",
    "Penso alla domanda e rispondo in italiano in modo chiaro.",
] * 20
