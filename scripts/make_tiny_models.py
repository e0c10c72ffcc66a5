#!/usr/bin/env python
"""Build tiny, hub-shaped models for tests and demos: a policy LM, a tokenizer and a
sentiment reward classifier, all trained locally from a synthetic review corpus.

Nothing can be downloaded on our machines, yet the CLI loads models with
``from_pretrained`` exactly as it would load a hub checkpoint. This script makes such
checkpoints in well under a minute on 2 CPU cores:

    OUT/policy/      Qwen2ForCausalLM warmed up on the corpus + tokenizer
    OUT/reward/      Qwen2ForSequenceClassification (negative/neutral/positive) + tokenizer
    OUT/corpus.txt   the synthetic corpus, one review per line (for reference)
    OUT/build_info.json  seed, sizes, measured EOS rate, classifier accuracy, seconds

Usage: python scripts/make_tiny_models.py [--out models/tiny] [--seed 0] [--force]

The build is deterministic: the same seed on the same torch build gives identical
weights. Everything is written to a temporary directory next to OUT and renamed into
place at the end, so an interrupted build never leaves a half-written OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

# BPE training on this corpus takes well under a second single-threaded; keeping the
# tokenizers library off its thread pool leaves nothing to chance and avoids its
# fork-after-parallelism warning if a caller forks later.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import (  # noqa: E402
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (  # noqa: E402
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

# --------------------------------------------------------------------------------------
# Sizes. Small enough to train in seconds on 2 cores, big enough to produce English-like
# review text and a near-perfect sentiment classifier on this template language.
# --------------------------------------------------------------------------------------
N_REVIEWS = 6000  # corpus size; the LM warm-up sees each review about twice
VOCAB_SIZE = 1280  # byte-level BPE target; the corpus saturates a little below this
HIDDEN = 96
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 4 * HIDDEN
MAX_LEN = 256  # model_max_length and max_position_embeddings

LM_STEPS = 450
LM_BATCH = 32
LM_LR = 5e-3

CLS_STEPS = 100
CLS_BATCH = 64
CLS_LR = 1e-3
CLS_HELDOUT_FRACTION = 0.1

EOS_EVAL_SAMPLES = 64
EOS_EVAL_NEW_TOKENS = 24

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
LABELS = ("negative", "neutral", "positive")

# --------------------------------------------------------------------------------------
# Corpus templates.
#
# A review is an opener ("The movie was"), a first-sentence continuation that carries the
# sentiment (" really great and I loved it."), then 0-3 more sentences of the same
# sentiment. The policy is later prompted with openers only, so the continuation is what
# it learns to write and what the classifier scores.
#
# Placeholders keep grammar right for plural subjects ("the headphones were ... they
# work ... I loved them"): {subj} is the subject pronoun, {it} the object pronoun, and
# {is} {was} {works} {does} {feels} {makes} agree with the subject. {done} {waste}
# {tried} {trying} pick the verb that fits the category (read / seen / used ...).
# --------------------------------------------------------------------------------------
SUBJECTS = {
    "book": ["the book", "the novel", "this book", "this novel", "the story", "the biography"],
    "movie": ["the movie", "the film", "this movie", "this film", "the show", "the sequel"],
    "product": [
        "the product", "this phone", "the blender", "the headphones", "this laptop",
        "the coffee maker", "the vacuum", "this camera", "the keyboard", "the backpack",
        "the speakers", "this kettle",
    ],
}
PLURAL_SUBJECTS = {"the headphones", "the speakers"}

# {s} is the subject, {S} the same capitalised at the start of a sentence.
OPENERS = [
    "I think {s} {was}", "I think {s} {is}", "{S} {was}", "{S} {is}",
    "Overall, {s} {is}", "Overall, {s} {was}", "Honestly, {s} {was}", "Honestly, {s} {is}",
    "In my opinion {s} {is}", "In my opinion {s} {was}", "I thought {s} {was}",
    "To be honest, {s} {is}", "I feel like {s} {is}", "My friend said {s} {was}",
    "I have to say {s} {is}", "For me, {s} {was}",
]

# First-sentence cores: what follows the opener's verb.
CORES = {
    "positive": [
        "really great", "great", "amazing", "wonderful", "excellent", "fantastic", "very good",
        "really good", "so much fun", "a pleasant surprise", "better than I expected",
        "absolutely brilliant", "lovely", "perfect", "incredible", "a real delight",
        "one of the best I have {done}", "truly special",
    ],
    "neutral": [
        "okay", "fine", "average", "just okay", "not bad but not great", "decent", "alright",
        "a bit mixed", "about what I expected", "pretty average", "neither good nor bad",
        "nothing to write home about", "somewhere in the middle", "so-so", "reasonable",
        "mostly fine",
    ],
    "negative": [
        "terrible", "awful", "boring", "really bad", "disappointing", "slow and boring",
        "very poor", "the worst I have ever {done}", "a mess", "a complete letdown",
        "a waste of {waste}", "horrible", "dull", "worse than I expected", "really annoying",
        "a total disaster",
    ],
}
# Optional tails that extend the first sentence (the other option is " because <clause>").
TAILS = {
    "positive": [
        " and I loved {it}", " and I would recommend {it} to anyone", ", I enjoyed every minute",
        " from start to finish", " and I was very happy with {it}", ", I am so glad I {tried} {it}",
    ],
    "neutral": [
        ", nothing special", ", but I have {done} better", " and I might try {it} again",
        ", some parts were good and some were not", ", not something I would rave about",
        " for what {subj} {is}",
    ],
    "negative": [
        " and I hated {it}", " and I would not recommend {it}", ", I want my money back",
        ", I regret {trying} {it}", " and I could not wait for {it} to end", ", avoid {it}",
    ],
}
CATEGORY_WORDS = {
    "book": {"done": "read", "waste": "time", "tried": "read", "trying": "reading"},
    "movie": {"done": "seen", "waste": "time", "tried": "watched", "trying": "watching"},
    "product": {"done": "used", "waste": "money", "tried": "bought", "trying": "buying"},
}

# Clauses that later sentences are built from: one clause, or two joined by a connector
# ("The plot was slow and the ending made no sense."). Two-clause sentences make reviews
# long enough in tokens that the 24-token EOS rate lands where we want it.
CLAUSES = {
    ("movie", "positive"): [
        "the acting was superb", "the story kept me hooked", "the ending was beautiful",
        "the music was lovely", "the plot was clever", "the cast did a great job",
        "I laughed a lot", "every scene looked gorgeous", "the director did a brilliant job",
        "I would happily watch {it} again", "the dialogue was sharp and funny",
        "the pacing was just right",
    ],
    ("movie", "neutral"): [
        "the plot was fine", "the ending was a bit weak", "some scenes were good",
        "other scenes were slow", "the acting was okay", "the middle part dragged",
        "the music was forgettable", "I might watch {it} again someday",
        "{subj} {was} a decent way to spend an evening", "the visuals were nice",
        "the jokes were hit and miss",
    ],
    ("movie", "negative"): [
        "the plot was slow", "the ending made no sense", "the acting was wooden",
        "I almost fell asleep", "I walked out halfway through", "the dialogue was awful",
        "the jokes fell flat", "the story went nowhere", "two hours of my life are gone",
        "the music was annoying", "the special effects looked cheap",
    ],
    ("book", "positive"): [
        "the characters were rich", "the writing was beautiful", "I could not put {it} down",
        "I read {it} in one sitting", "the ending was perfect", "the author has a wonderful voice",
        "every chapter left me wanting more", "the dialogue felt real",
        "I will read {it} again next year", "the plot twists were clever",
    ],
    ("book", "neutral"): [
        "the writing was fine", "the middle dragged a little", "some chapters were good",
        "other chapters were dull", "the characters were okay", "the ending was predictable",
        "{subj} {was} an easy read", "I finished {it} in a week", "the pacing was uneven",
        "I may read the next one",
    ],
    ("book", "negative"): [
        "the plot was slow", "the ending made no sense", "the characters were flat",
        "I gave up after a few chapters", "the writing was clumsy",
        "nothing happened for two hundred pages", "I could barely finish {it}",
        "the dialogue was painful", "the twists were obvious",
    ],
    ("product", "positive"): [
        "{subj} {works} perfectly", "the battery lasts all day", "the quality is excellent",
        "setup was quick and easy", "{subj} {was} worth every penny",
        "{subj} {feels} solid and well made", "I use {it} every day", "shipping was fast",
        "the design is beautiful", "{subj} {is} very easy to use",
    ],
    ("product", "neutral"): [
        "{subj} {does} the job", "the quality is fine for the price",
        "the battery could be better", "setup took a while", "{subj} {feels} a little cheap",
        "{subj} {works} well enough", "{subj} {is} fine for everyday use",
        "the design is plain", "the instructions were a bit confusing",
    ],
    ("product", "negative"): [
        "{subj} broke after a week", "the quality is poor", "{subj} {feels} cheap",
        "customer support was no help", "I returned {it} the next day",
        "the battery died after an hour", "{subj} stopped working after a month",
        "the buttons are flimsy", "{subj} {makes} a horrible noise",
    ],
}
CONNECTORS = {
    "positive": [" and ", ", and ", " and also ", ", plus "],
    "neutral": [" but ", ", but ", " and ", ", although "],
    "negative": [" and ", ", and ", " and also ", ", plus ", " and worst of all "],
}
# Short stand-alone sentences that fit any category.
SHORT = {
    "positive": [
        "I would recommend {it} to anyone.", "Five stars.", "I loved {it}.",
        "Highly recommended.", "{Subj} made my week.", "Absolutely worth {it}.",
    ],
    "neutral": [
        "Three stars.", "{Subj} {was} fine, I guess.", "I do not have strong feelings about {it}.",
        "{Subj} {is} not bad, not great.", "Your mileage may vary.", "{Subj} {was} just okay.",
    ],
    "negative": [
        "One star.", "Avoid {it}.", "I would not recommend {it}.", "What a disappointment.",
        "Do not waste your time.", "{Subj} {was} a huge letdown.",
    ],
}

# Sentences per review. One- and two-sentence reviews make the LM stop within 24 new
# tokens only sometimes (~10-30% at temperature 1.0): long enough that an untrained
# policy rarely stops early, short ones common enough for RL to discover stopping.
LENGTH_WEIGHTS = {1: 0.05, 2: 0.12, 3: 0.38, 4: 0.45}
P_TWO_CLAUSES = 0.85
P_SHORT = 0.1


def _words(subject: str, category: str) -> dict[str, str]:
    if subject in PLURAL_SUBJECTS:
        w = {"subj": "they", "it": "them", "is": "are", "was": "were", "works": "work",
             "does": "do", "feels": "feel", "makes": "make"}
    else:
        w = {"subj": "it", "it": "it", "is": "is", "was": "was", "works": "works",
             "does": "does", "feels": "feels", "makes": "makes"}
    return {**w, "Subj": w["subj"].capitalize(), **CATEGORY_WORDS[category]}


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def make_opener(rng: random.Random, subject: str, category: str) -> str:
    return rng.choice(OPENERS).format(s=subject, S=_cap(subject), **_words(subject, category))


def make_review(rng: random.Random) -> tuple[str, str, list[str], int]:
    """One review: (opener, continuation, sentences, label). The full text is
    opener + continuation; the continuation starts with a space, like a model response."""
    category = rng.choice(sorted(SUBJECTS))
    sentiment = rng.choice(LABELS)
    subject = rng.choice(SUBJECTS[category])
    words = _words(subject, category)
    opener = make_opener(rng, subject, category)
    # Clauses are drawn without replacement so a review does not repeat itself.
    clauses = rng.sample(CLAUSES[(category, sentiment)], len(CLAUSES[(category, sentiment)]))
    shorts = rng.sample(SHORT[sentiment], len(SHORT[sentiment]))

    core = rng.choice(CORES[sentiment])
    r = rng.random()
    tail = (rng.choice(TAILS[sentiment]) if r < 0.45
            else " because " + clauses.pop() if r < 0.75 else "")
    end = "!" if sentiment == "positive" and rng.random() < 0.15 else "."
    first = (" " + core + tail + end).format(**words)

    n_sent = rng.choices(list(LENGTH_WEIGHTS), weights=list(LENGTH_WEIGHTS.values()))[0]
    follow = []
    for _ in range(n_sent - 1):
        if rng.random() < P_SHORT:
            follow.append(shorts.pop().format(**words))
            continue
        s = clauses.pop()
        if rng.random() < P_TWO_CLAUSES:
            s += rng.choice(CONNECTORS[sentiment]) + clauses.pop()
        follow.append(_cap(s.format(**words)) + ("!" if end == "!" and rng.random() < 0.3 else "."))
    sentences = [opener + first] + follow
    continuation = first + "".join(" " + s for s in follow)
    return opener, continuation, sentences, LABELS.index(sentiment)


def make_corpus(seed: int, n: int) -> list[tuple[str, str, list[str], int]]:
    rng = random.Random(seed)
    return [make_review(rng) for _ in range(n)]


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    # Byte-level BPE: every string is encodable and decode() returns the exact text,
    # spaces included. Special tokens come first so their ids are 0 and 1.
    #
    # AutoTokenizer loads any tokenizer saved next to a qwen2 config.json as
    # Qwen2Tokenizer, which rebuilds the pipeline from vocab and merges with Qwen's own
    # NFC normaliser and split regex. Training with exactly that pipeline makes the
    # tokenizer we train with and the one every consumer loads the same tokenizer
    # (build() checks this after saving).
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",  # decoder-only batched generation needs left padding
        model_max_length=MAX_LEN,
    )


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------
def make_config(tokenizer: PreTrainedTokenizerFast, **extra) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **extra,
    )


def pad_batch(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


def warmup_lr(step: int, total: int, peak: float) -> float:
    # Short linear warm-up then linear decay: stable from a random init and lands at a
    # low LR so the final weights are not mid-oscillation.
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * max(0.05, (total - step) / (total - warm))


def train_lm(tokenizer, texts: list[str], gen: torch.Generator) -> Qwen2ForCausalLM:
    model = Qwen2ForCausalLM(make_config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Each review is its own row starting at position 0 followed by EOS, the same shape as
    # a prompt at generation time, so the model learns where reviews start and stop.
    encoded = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    opt = torch.optim.AdamW(model.parameters(), lr=LM_LR, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    for step in range(LM_STEPS):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, LM_STEPS, LM_LR)
        idx = torch.randint(len(encoded), (LM_BATCH,), generator=gen).tolist()
        ids, mask = pad_batch([encoded[i] for i in idx], tokenizer.pad_token_id, left=False)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == LM_STEPS - 1:
            print(f"  lm step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()
    return model


def classifier_examples(reviews, rng: random.Random) -> list[tuple[str, int]]:
    """Texts the reward model must label: whole reviews, single sentences, and the
    continuation without its opener (what a policy response looks like), also cut off
    mid-sentence the way a max_new_tokens limit cuts a response; bare openers are
    neutral."""
    out = []
    neutral = LABELS.index("neutral")
    for opener, cont, sentences, label in reviews:
        # An opener alone says nothing yet: scoring prompt + an empty response should
        # not reward or punish the policy.
        if rng.random() < 0.1:
            out.append((opener, neutral))
        out.append((opener + cont, label))
        out.append((cont, label))
        out.append((rng.choice(sentences), label))
        words = cont.split(" ")
        if len(words) > 4:
            cut = rng.randint(3, len(words) - 1)
            out.append((" ".join(words[:cut]), label))
    return out


def train_classifier(tokenizer, lm: Qwen2ForCausalLM, train, gen: torch.Generator):
    model = Qwen2ForSequenceClassification(make_config(
        tokenizer,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
    ))
    # Start from the warmed-up LM's body: it already models this language, so the
    # classifier converges in a few seconds (the score head starts from scratch).
    missing, _ = model.load_state_dict(lm.state_dict(), strict=False)
    assert all(k.startswith("score.") for k in missing), missing
    encoded = tokenizer([t for t, _ in train])["input_ids"]
    labels = torch.tensor([y for _, y in train])
    opt = torch.optim.AdamW(model.parameters(), lr=CLS_LR, weight_decay=0.01)
    model.train()
    for step in range(CLS_STEPS):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, CLS_STEPS, CLS_LR)
        idx = torch.randint(len(encoded), (CLS_BATCH,), generator=gen)
        # Left padding, as the reward model sees batches from the left-padding tokenizer;
        # it pools the last non-pad token (config.pad_token_id), so either side works.
        ids, mask = pad_batch([encoded[i] for i in idx.tolist()], tokenizer.pad_token_id, left=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels[idx]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == CLS_STEPS - 1:
            print(f"  cls step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()
    return model


@torch.no_grad()
def classify(model, tokenizer, texts: list[str], batch: int = 256) -> list[int]:
    preds = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True)
        preds += model(**enc).logits.argmax(-1).tolist()
    return preds


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], seed: int) -> tuple[list[str], float]:
    """Sample at temperature 1.0 (no top-k/top-p) and return the responses and the
    fraction that emitted EOS within EOS_EVAL_NEW_TOKENS."""
    torch.manual_seed(seed)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=EOS_EVAL_NEW_TOKENS,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    new = out[:, enc["input_ids"].shape[1]:]
    stopped = (new == tokenizer.eos_token_id).any(dim=1)
    responses = tokenizer.batch_decode(new, skip_special_tokens=True)
    return responses, stopped.float().mean().item()


def check_reload(path: Path, tokenizer, texts: list[str]) -> None:
    """Fail the build if the saved tokenizer does not load back as the one we trained."""
    loaded = AutoTokenizer.from_pretrained(path)
    probes = texts + ["Price: $1,234.56 -- naive cafe\u0301 :)  two  spaces\nnew line", " I'm 42!"]
    for text in probes:
        if loaded(text)["input_ids"] != tokenizer(text)["input_ids"]:
            raise RuntimeError(f"saved tokenizer encodes {text!r} differently after reload")
    if (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) != (
        tokenizer.eos_token_id, tokenizer.pad_token_id, "left"
    ):
        raise RuntimeError("saved tokenizer lost its eos/pad/padding side after reload")


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------
REQUIRED_FILES = (
    "build_info.json", "corpus.txt",
    "policy/model.safetensors", "policy/config.json", "policy/tokenizer.json",
    "reward/model.safetensors", "reward/config.json", "reward/tokenizer.json",
)


def is_complete(out: Path) -> bool:
    return all((out / f).is_file() for f in REQUIRED_FILES)


def build(out_tmp: Path, seed: int) -> dict:
    t0 = time.perf_counter()

    def lap() -> str:
        return f"{time.perf_counter() - t0:5.1f}s"

    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(seed)

    reviews = make_corpus(seed, N_REVIEWS)
    texts = [o + c for o, c, _, _ in reviews]
    (out_tmp / "corpus.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")

    tokenizer = train_tokenizer(texts)
    print(f"[{lap()}] tokenizer: vocab {len(tokenizer)}  eos {tokenizer.eos_token_id}  "
          f"pad {tokenizer.pad_token_id}", flush=True)

    print(f"[{lap()}] warming up the policy LM", flush=True)
    lm = train_lm(tokenizer, texts, gen)

    # Held-out reviews for the classifier come from the tail of the corpus, which the
    # classifier never trains on (the LM body it starts from did see them as text).
    n_held = int(len(reviews) * CLS_HELDOUT_FRACTION)
    ex_rng = random.Random(seed + 1)
    train_ex = classifier_examples(reviews[:-n_held], ex_rng)
    held_ex = classifier_examples(reviews[-n_held:], ex_rng)
    print(f"[{lap()}] training the reward classifier on {len(train_ex)} texts", flush=True)
    cls = train_classifier(tokenizer, lm, train_ex, gen)
    preds = classify(cls, tokenizer, [t for t, _ in held_ex])
    accuracy = sum(p == y for p, (_, y) in zip(preds, held_ex)) / len(held_ex)
    print(f"[{lap()}] classifier held-out accuracy: {accuracy:.4f} ({len(held_ex)} texts)",
          flush=True)

    prompt_rng = random.Random(seed + 2)
    prompts = []
    for _ in range(EOS_EVAL_SAMPLES):
        category = prompt_rng.choice(sorted(SUBJECTS))
        prompts.append(make_opener(prompt_rng, prompt_rng.choice(SUBJECTS[category]), category))
    responses, eos_rate = sample(lm, tokenizer, prompts, seed)
    labels = classify(cls, tokenizer, responses)
    print(f"[{lap()}] EOS within {EOS_EVAL_NEW_TOKENS} new tokens at T=1.0: {eos_rate:.3f} "
          f"over {len(prompts)} samples", flush=True)
    print("samples (reward label of the response in brackets):")
    for p, r, y in list(zip(prompts, responses, labels))[:6]:
        print(f"  [{LABELS[y]:>8}] {p}|{r}")

    for sub, model in (("policy", lm), ("reward", cls)):
        model.save_pretrained(out_tmp / sub, safe_serialization=True)
        tokenizer.save_pretrained(out_tmp / sub)
    check_reload(out_tmp / "policy", tokenizer, texts[:500])

    info = {
        "seed": seed,
        "n_reviews": len(reviews),
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTERMEDIATE,
        "policy_parameters": sum(p.numel() for p in lm.parameters()),
        "reward_parameters": sum(p.numel() for p in cls.parameters()),
        "lm_steps": LM_STEPS,
        "classifier_steps": CLS_STEPS,
        "eos_rate_within_24_tokens": round(eos_rate, 4),
        "eos_eval_samples": len(prompts),
        "classifier_heldout_accuracy": round(accuracy, 4),
        "torch_version": torch.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    # Written last: its presence marks a complete build.
    (out_tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if OUT is complete")
    args = ap.parse_args(argv)
    out: Path = args.out

    if is_complete(out) and not args.force:
        print(f"{out} is already complete; use --force to rebuild")
        return 0

    # Two threads: fast on our 2-core machines, and a fixed count keeps CPU reductions in
    # the same order from run to run (part of what makes builds reproducible).
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    # SIGTERM (a test runner's timeout, say) should clean up like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        info = build(tmp, args.seed)
        if is_complete(out) and not args.force:
            # Another process built OUT while we were building (parallel test workers);
            # same seed, same bytes, so keep theirs and drop ours.
            shutil.rmtree(tmp)
            print(f"{out} was completed by another build meanwhile; kept it")
            return 0
        # Swap into place; the old OUT (if any) is removed only after the new one is in.
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
