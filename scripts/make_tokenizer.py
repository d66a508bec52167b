"""Train the small offline tokenizer shipped in assets/tokenizer (used with random-weight models).

A word-level-ish BPE over a few hundred lines of prompt-like English, with T5's special tokens
(<pad>=0, </s>=1, <unk>=2) and T5's trailing </s>, so that pipelines which expect a T5/UMT5 tokenizer run without a hub.

    python scripts/make_tokenizer.py  # writes assets/tokenizer/tokenizer.json
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

OUT = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"

SUBJECTS = [
    "a cat",
    "a dog",
    "an astronaut",
    "a red fox",
    "two children",
    "a robot",
    "a sailboat",
    "a dancer",
    "an old man",
    "a hummingbird",
    "a city street",
    "a waterfall",
    "a lighthouse",
    "a train",
    "a dragon",
]
ACTIONS = [
    "walking",
    "running",
    "flying",
    "dancing",
    "sleeping",
    "jumping",
    "swimming",
    "reading",
    "painting",
    "playing",
    "turning",
    "glowing",
    "falling",
    "rising",
]
PLACES = [
    "on the beach",
    "in a forest",
    "on the moon",
    "in the rain",
    "at sunset",
    "under water",
    "in a city",
    "in the snow",
    "in a desert",
    "on a mountain",
    "in a kitchen",
    "in space",
    "at night",
]
STYLES = [
    "cinematic",
    "slow motion",
    "close-up",
    "wide shot",
    "4k",
    "film grain",
    "soft light",
    "vivid colors",
    "low angle",
    "aerial view",
    "high quality",
    "realistic",
    "blurry",
    "static",
    "overexposed",
    "worst quality",
]


def corpus() -> list[str]:
    lines = [f"{s} {a} {p}, {st}" for s, a, p, st in itertools.product(SUBJECTS, ACTIONS, PLACES, STYLES[:4])]
    lines += [", ".join(STYLES[i : i + 5]) for i in range(len(STYLES))]
    return lines


def main() -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(  # T5 appends </s> to every sequence
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
    )
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    print(f"wrote {OUT / 'tokenizer.json'} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
