"""Per-request stops of a batched draft round (specstop.decode.row_stops), against a brute-force walk:
each row alone through its own policy's ``should_stop``, one step at a time."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _export_fixtures import per_setting_copy, random_exports, single_thread  # noqa: F401 - tiny models run faster on one thread

from specstop.decode.row_stops import RowStops, row_setting
from specstop.export.runtime import StoppingPolicy
from specstop.probs import DecodingConfig

GREEDY, WARM = DecodingConfig(), DecodingConfig(temperature=0.7, top_p=0.9)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_pair_dir):
    from specstop.pair.loader import load_pair

    pair = load_pair(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), dtype="float32", device="cpu")
    return random_exports(tmp_path_factory.mktemp("row_stop_exports"), pair), pair


def _brute_force(policy: StoppingPolicy, settings, steps, positions, cap, vocab, eos=()):
    """Each row alone: its setting's policy copy decides after every token, until stop, cap or EOS; each
    row's ``(length, why it ended)``."""
    out = []
    for b, setting in enumerate(settings):
        p = StoppingPolicy(policy.spec, policy.predictor, config=policy.config).configure(setting, vocab)
        p.reset()
        row_cap = min(cap, p.cap())
        n, why = 0, "cap"
        for j, (logits, hidden, tokens) in enumerate(steps):
            if n >= row_cap:
                break
            n += 1
            stop = p.should_stop(logits[b], hidden[b], int(positions[b]) + j, draft_token=int(tokens[b]))
            if n >= row_cap:
                break
            if int(tokens[b]) in eos or stop:
                why = "eos" if int(tokens[b]) in eos else "policy"
                break
        out.append((n, why))
    return out


@pytest.mark.parametrize("name", ["confidence", "disco", "sdpp"])
def test_rows_stop_where_each_row_alone_would(name, exports):
    export_paths, pair = exports
    vocab = pair.vocab_size
    policy = (StoppingPolicy.from_string("confidence:0.2") if name == "confidence" else
              StoppingPolicy.from_pretrained(export_paths[name]))
    gen = torch.Generator().manual_seed(3)
    rows, cap = 8, 5
    settings = [GREEDY, WARM, GREEDY, WARM, WARM, GREEDY, WARM, GREEDY]
    positions = torch.randint(0, 30, (rows,), generator=gen)
    # The draft's own steps (its logits, padding columns included, and last-layer states), greedy drafts
    ids = torch.randint(3, vocab - 1, (rows, 6), generator=gen)
    steps = []
    with torch.no_grad():
        for _ in range(cap):
            out = pair.draft(ids, output_hidden_states=True)
            logits, hidden = out.logits[:, -1].float(), out.hidden_states[-1][:, -1].float()
            steps.append((logits, hidden, logits[:, :vocab].argmax(-1)))
            ids = torch.cat([ids, steps[-1][2][:, None]], dim=1)
    eos = (int(steps[2][2][4]),)  # row 4 drafts an EOS at step 3 (unless it stopped before)
    want, why = zip(*_brute_force(policy, settings, steps, positions, cap, vocab, eos))

    stops = RowStops(policy, vocab, eos=eos, live=False, log=lambda line: None)
    assert stops.begin(settings, cap) == min(cap, policy.cap())
    stops.place(positions.tolist())
    done, used = False, 0
    for logits, hidden, tokens in steps:
        used += 1
        if stops.step(logits, hidden if policy.needs_hidden else None, tokens):
            done = True
            break
    drafted = torch.stack([t for _, _, t in steps[:used]], dim=1)
    got = stops.cut(drafted)
    assert [len(d) for d in got] == list(want)
    assert stops.stats["ends"] == dict(Counter(why)), why  # each row's end counted once, under its reason
    assert name != "confidence" or set(why) == {"cap", "eos", "policy"}, why
    assert done and used == max(want)  # the round ends with its last drafting row, not at the cap
    assert all(d == drafted[b, : len(d)].tolist() for b, d in enumerate(got))
    assert len({len(d) for d in got}) > 1, want  # the check is not vacuous: rows stop apart


def test_each_setting_runs_its_own_entry_and_says_so(exports, tmp_path):
    export_paths, pair = exports
    folder = per_setting_copy(export_paths["static"], tmp_path / "per_setting",
                              {(0.0, 1.0): {"kind": "static", "k": 3}, (0.7, 0.9): {"kind": "static", "k": 1}})
    lines: list[str] = []
    stops = RowStops(StoppingPolicy.from_pretrained(folder), pair.vocab_size, live=False, log=lines.append)
    # vLLM's float32 arrays: 0.7 reads 0.699999988, and "no top-k" is the vocabulary size
    settings = [row_setting(t, k, p, pair.vocab_size) for t, k, p in
                [(0.0, pair.vocab_size, 1.0), (0.699999988, pair.vocab_size, 0.899999976), (0.0, 0, 1.0)]]
    assert settings == [GREEDY, WARM, GREEDY]
    assert stops.begin(settings, 6) == 3
    assert stops.caps.tolist() == [3, 1, 3]
    assert lines == ["specstop: requests at greedy run static:3 (policy static @ greedy: the by_decoding entry tuned "
                     "at greedy)", "specstop: requests at T=0.7, top-p 0.9 run static:1 (policy static @ T=0.7, top-p 0.9: "
                     "the by_decoding entry tuned at T=0.7, top-p 0.9)"]
    stops.begin(settings, 2)
    assert stops.caps.tolist() == [2, 1, 2] and len(lines) == 2  # the engine's K caps too; each setting logged once


@pytest.fixture
def asked(monkeypatch) -> list[int]:
    """The rows each policy call was asked about, one entry per ``should_stop_batch`` call."""
    calls: list[int] = []
    real = StoppingPolicy.should_stop_batch

    def counting(self, logits, *args, **kwargs):
        calls.append(int(kwargs["active"].sum()))
        return real(self, logits, *args, **kwargs)

    monkeypatch.setattr(StoppingPolicy, "should_stop_batch", counting)
    return calls


def test_rows_at_their_cap_stop_without_asking_their_policy(exports, asked):
    """A row whose next token reaches its cap stops there whatever its policy says, so the policy is not run for
    it: at a cap of 1 (the runner's cap at large batch sizes) a round asks no policy at all."""
    _, pair = exports
    vocab = pair.vocab_size
    policy = StoppingPolicy.from_string("confidence:1e-6")  # never stops by itself
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    tokens = logits.argmax(-1)
    stops = RowStops(policy, vocab, live=False, log=lambda line: None)
    stops.begin([GREEDY, WARM, GREEDY, WARM], 1)
    assert stops.step(logits, None, tokens) and asked == []
    assert [len(d) for d in stops.cut(tokens[:, None])] == [1, 1, 1, 1]
    stops.begin([GREEDY, WARM, GREEDY, WARM], 2)
    assert not stops.step(logits, None, tokens) and asked == [2, 2]  # each setting's two rows, once
    assert stops.step(logits, None, tokens) and asked == [2, 2]  # the second token reaches the cap


def test_an_exact_round_drafts_every_rows_cap_and_still_asks_the_policy(exports, asked):
    """A cost sweep's round (``exact``): every row drafts its cap whatever its policy and EOS say, and the policy
    still decides at every step (its cost is part of the step the sweep prices)."""
    _, pair = exports
    vocab = pair.vocab_size
    policy = StoppingPolicy.from_string("confidence:0.999999")  # stops every row at its first token
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    tokens = logits.argmax(-1)
    stops = RowStops(policy, vocab, eos=[int(tokens[0])], live=False, log=lambda line: None)
    stops.begin([GREEDY] * 3, 3)
    assert stops.step(logits, None, tokens)  # row 0 drafted its EOS, and the policy stops every row
    stops.begin([GREEDY] * 3, 3, exact=True)
    asked.clear()
    done = [stops.step(logits, None, tokens) for _ in range(3)]
    assert done == [False, False, True] and asked == [3, 3]  # the third token reaches the cap unasked
    assert [len(d) for d in stops.cut(tokens[:, None].repeat(1, 3))] == [3, 3, 3]
    assert stops.stats["ends"] == {"eos": 1, "policy": 2, "cap": 3}  # the first round's ends, then the sweep's


def test_a_row_drafts_no_more_than_its_request_can_keep(exports):
    """A request with L tokens left keeps at most L from its next verification (its bonus token among them): its
    draft ends at L - 1 tokens, given before the round or once the first pass placed it (then a row with one token
    left keeps none of the token it drafted); a cost sweep's exact round drafts its cap whatever the room."""
    _, pair = exports
    vocab = pair.vocab_size
    policy = StoppingPolicy.from_string("confidence:1e-6")  # never stops by itself
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    tokens = logits.argmax(-1)
    drafted = tokens[:, None].repeat(1, 5)
    stops = RowStops(policy, vocab, live=False, log=lambda line: None)
    assert stops.begin([GREEDY] * 4, 5, positions=[0, 0, 0, 0], room=[0, 2, 9, 4]) == 5
    while not stops.step(logits, None, tokens):
        pass
    assert [len(d) for d in stops.cut(drafted)] == [0, 2, 5, 4]
    assert stops.stats["ends"] == {"room": 2, "cap": 1}  # the row with no room never drafted
    assert stops.begin([GREEDY] * 4, 5, room=[2, 2, 2, 2]) == 2
    # room learned from the first pass's positions, as vLLM's runner learns them: placed before its first step
    stops.begin([GREEDY] * 4, 5)
    stops.place([0, 0, 0, 0], room=[0, 1, 3, 9])
    assert not stops.step(logits, None, tokens) and stops.stopped.tolist() == [True, True, False, False]
    while not stops.step(logits, None, tokens):
        pass
    assert [len(d) for d in stops.cut(drafted)] == [0, 1, 3, 5]
    stops.begin([GREEDY] * 4, 3, positions=[0, 0, 0, 0], room=[0, 1, 1, 1], exact=True)
    assert [stops.step(logits, None, tokens) for _ in range(3)] == [False, False, True]
    assert [len(d) for d in stops.cut(drafted)] == [3, 3, 3, 3]
