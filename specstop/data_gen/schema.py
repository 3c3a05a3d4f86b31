"""The on-disk schema of a specstop dataset (version 1).

A dataset folder holds ``manifest.json`` and ``shards/<shard>/<table>/`` Hugging Face ``datasets``
Arrow folders. Every shard covers a fixed set of prompts of one split and holds four tables:

``sequences`` - one row per prompt:
    prompt_id, split, prompt_text, prompt_ids, response_ids (X_0..X_{N-1}), response_text,
    num_tokens (N), stop_reason ("eos" | "length"), prompt_truncated.

``tokens`` - one row per response position i (teacher forcing over x + X):
    position i (0-based, from the start of the response); token X_i; draft_argmax = argmax q_i;
    topk = the k largest probabilities of q_i (sorted); topk_ids = their token ids (same order);
    target_rank = the rank of X_i among topk_ids, or -1 when X_i is not among them (labels
    version 4: a token tree's candidate children at i and which one the target accepts);
    entropy of q_i (nats);
    tv = TV(p_i, q_i); accept_expected = 1 - tv; greedy_match = [argmax q_i == X_i];
    draft_token Y_i ~ q_i (seeded); accept_prob = min(1, p_i(Y_i) / q_i(Y_i));
    verified ~ Bernoulli(accept_prob) (seeded); target_top1 = argmax p_i;
    target_prob = p_i(X_i), draft_prob = q_i(X_i) (so a draft token equal to X_i is accepted
    with probability min(1, draft_prob / target_prob) given that X_i is emitted);
    reject_token Y'_i ~ norm(max(q_i - p_i, 0)) (seeded; greedy: argmax q_i), the token a
    rejection at i drafted, and reject_draft_prob = q_i(Y'_i) (labels version 3);
    hidden (optional, float16) = the draft's final hidden state after X_i is fed in.

``mixed`` - SpecDec++ token mixing rows (only positions holding a draft token):
    draw, position i, draft_token Y_i; topk/entropy of the mixed pass's q(. | x, Z_<i);
    hidden = e_i(x, Z_<i, Y_i) (float16, after Y_i is fed in);
    accept_prob / accept_expected: the teacher-forced labels of Y_i (as in SpecDec++ 4.4).

``rollouts`` - one row per mismatch position m of a greedy response (eval splits by default);
    for sampled data one row per position where a rejection is possible (q_m(X_m) < p_m(X_m) or
    any TV), with d_m = reject_token Y'_m:
    position m, mismatch_token d_m = argmax q_m != X_m; length n <= L;
    tokens r_1..r_n (greedy draft continuation of x, X_<m, d_m, stopped after EOS);
    topk [n*k] / entropy [n]: features of q(. | x, X_<m, d_m, r_<j) for step j;
    mismatch_hidden = h(d_m); hidden [n*H] = h(r_j) (both optional, float16).

Feature alignment (the one rule every consumer follows): a *row describes a drafted token*.
Its distribution features (topk, entropy) are those of the distribution the token is drawn from
(q_i for position i); its ``hidden`` is the draft's final hidden state *after that token is fed
in* (the state that also yields q_{i+1}). DISCO and the MCSD top-k model read the former when
deciding about the token; SpecDec++ and the MCSD hidden-state model read the latter, which only
exists one draft step later - so they judge token j-1 when token j has been drafted (SpecDec++
Algorithm 1).

Temperature 0 (greedy): features and labels use the untempered softmax (see specstop.probs).
"""

from __future__ import annotations

SCHEMA_VERSION = 1

TABLES = ("sequences", "tokens", "mixed", "rollouts")

# Columns every table carries to identify the prompt.
ID_COLUMNS = ("prompt_id", "split")


def features_for(table: str, k: int, hidden_size: int | None):
    """The ``datasets.Features`` of ``table`` for top-k size ``k`` and optional hidden states.

    ``hidden_size=None`` means hidden states are not stored (the columns are absent).
    """
    from datasets import Features, List, Value

    ids = {"prompt_id": Value("string"), "split": Value("string")}
    if table == "sequences":
        f = {
            **ids,
            "prompt_text": Value("string"),
            "prompt_ids": List(Value("int32")),
            "response_ids": List(Value("int32")),
            "response_text": Value("string"),
            "num_tokens": Value("int32"),
            "stop_reason": Value("string"),
            "prompt_truncated": Value("bool"),
        }
    elif table == "tokens":
        f = {
            **ids,
            "position": Value("int32"),
            "token": Value("int32"),
            "draft_argmax": Value("int32"),
            "target_top1": Value("int32"),
            "topk": List(Value("float32"), length=k),
            "topk_ids": List(Value("int32"), length=k),
            "target_rank": Value("int32"),
            "entropy": Value("float32"),
            "tv": Value("float32"),
            "accept_expected": Value("float32"),
            "greedy_match": Value("bool"),
            "draft_token": Value("int32"),
            "accept_prob": Value("float32"),
            "verified": Value("bool"),
            "target_prob": Value("float32"),
            "draft_prob": Value("float32"),
            "reject_token": Value("int32"),
            "reject_draft_prob": Value("float32"),
        }
        if hidden_size:
            f["hidden"] = List(Value("float16"), length=hidden_size)
    elif table == "mixed":
        f = {
            **ids,
            "draw": Value("int32"),
            "position": Value("int32"),
            "draft_token": Value("int32"),
            "topk": List(Value("float32"), length=k),
            "entropy": Value("float32"),
            "accept_prob": Value("float32"),
            "accept_expected": Value("float32"),
        }
        if hidden_size:
            f["hidden"] = List(Value("float16"), length=hidden_size)
    elif table == "rollouts":
        f = {
            **ids,
            "position": Value("int32"),
            "mismatch_token": Value("int32"),
            "length": Value("int32"),
            "tokens": List(Value("int32")),
            "topk": List(Value("float32")),
            "entropy": List(Value("float32")),
        }
        if hidden_size:
            f["mismatch_hidden"] = List(Value("float16"), length=hidden_size)
            f["hidden"] = List(Value("float16"))
    else:
        raise ValueError(f"unknown table {table!r}; tables are {TABLES}")
    return Features(f)
