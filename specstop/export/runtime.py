"""The dependency-light runtime: one :class:`StoppingPolicy` for every stopping rule.

Decoders (our :class:`~specstop.decode.chain.SpeculativeDecoder`, the Hugging Face assisted
generation hook, or your own loop) ask one object "stop drafting now?" after each drafted token.
Static, heuristic, confidence and learned predictors all answer through the same calls, so a
decoder switches policy by configuration.

Imports: only torch, safetensors, huggingface_hub, the standard library and ``specstop.models`` /
``specstop.policy`` / ``specstop.probs`` (no Lightning, datasets or transformers;
``tests/test_export_runtime.py`` checks this). :class:`StoppingPolicy` is a huggingface_hub
``ModelHubMixin``: ``from_pretrained`` takes an export folder or a hub id, ``save_pretrained`` /
``push_to_hub`` write and upload the same folder layout ``specstop export`` writes.

Per sequence, ``policy.start_sequence()``; then per round (batch size 1)::

    policy.reset()
    for j in 1, 2, ...:
        logits_j, hidden_prev = draft step          # one draft forward yields both
        y_j = pick from logits_j
        if policy.should_stop(logits_j, hidden_prev, position=s + j - 1) or j == K_cap or y_j == EOS:
            break
    verify ...; policy.end_round(num_drafted, num_accepted)

``draft_logits`` (``[V_model]``) are the logits y_j was drawn from (q_j); ``draft_hidden``
(``[H]``) is the draft's final hidden state *after the previous drafted token y_{j-1} was fed in*
- the state from the same forward that produced q_j - and ``None`` at j = 1. Hidden-state heads
(SpecDec++, MCSD hidden) therefore score e_{j-1} when token j has been drafted, exactly as
SpecDec++ Algorithm 1 does; distribution heads (DISCO, MCSD top-k) score q_j itself. The batched
form (:meth:`StoppingPolicy.should_stop_batch`) keeps one state machine per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelHubMixin

from specstop.errors import UserError
from specstop.export.folder import (
    CONFIG_NAME,
    EXPORT_FORMAT,
    NODE_HEAD_NAME,
    SCHEMA_VERSION,
    WEIGHTS_NAME,
    export_config,
    write_export_files,
)
from specstop.export.hub import LIBRARY_NAME, names_hub_repo, resolve_folder
from specstop.export.reading import DraftMismatchError, identity_matches, load_predictor_weights, read_export
from specstop.models import FeatureSpec, StoppingPredictor
from specstop.policy import PolicySpec, RoundPolicy, StepFeatures, make_round_policy, parse_policy_string
from specstop.probs import DecodingConfig, logits_to_probs

__all__ = [
    "CONFIG_NAME",
    "EXPORT_FORMAT",
    "SCHEMA_VERSION",
    "NODE_HEAD_NAME",
    "WEIGHTS_NAME",
    "DraftMismatchError",
    "StoppingPolicy",
    "check_policy_inputs",
    "identity_matches",
]



def check_policy_inputs(policy: StoppingPolicy, hidden_size: int | None, where: str = "the policy") -> None:
    """Refuse a policy whose predictor reads draft hidden states of another width than the draft's.

    ``--allow-draft-mismatch`` lets a predictor run on another draft's features; it cannot make a
    ``[B, 896]`` layer read a ``[B, 64]`` state (that is a shape error deep inside the decoder).

    Raises:
        UserError: naming both sizes.
    """
    fs = policy.feature_spec
    if fs is None or hidden_size is None or not (fs.reads_hidden or fs.reads_state) or fs.hidden_size == hidden_size:
        return
    raise UserError(
        f"{where} reads draft hidden states of size {fs.hidden_size} but this draft's hidden size is {hidden_size}; "
        "--allow-draft-mismatch cannot bridge different sizes: use a policy exported for this draft "
        "(or a rule such as confidence:0.4)"
    )


class StoppingPolicy(
    ModelHubMixin,
    library_name=LIBRARY_NAME,
    tags=["speculative-decoding", "stopping-policy"],
):
    """A stopping rule plus (for learned policies) the predictor that scores draft steps.

    Build with :meth:`from_pretrained` (an export folder), :meth:`from_spec` (a
    :class:`~specstop.policy.PolicySpec`, optionally with a predictor) or :meth:`from_string`
    (``static:4``, ``heuristic``, ``confidence:0.4``). :meth:`load` accepts either a folder or a string.

    Attributes:
        spec: the policy spec (threshold, SL_max, rule, ...).
        predictor: the scoring module, or None for static/heuristic/confidence.
        feature_spec: what the predictor reads (None without a predictor).
        config: the export's config.json (empty when not loaded from an export).
        decoding: the decoding transform used to turn ``draft_logits`` into q for features; set by
            the decoder with :meth:`configure` (default: greedy).
        vocab_size: the shared tokenizer vocabulary (logits beyond it are dropped).
        setting: the decoding setting ``spec`` was tuned at, when the export carries one per setting
            (``by_decoding``: :meth:`configure` switches ``spec`` to the request's); else None.
    """

    def __init__(
        self,
        spec: PolicySpec,
        predictor: StoppingPredictor | None = None,
        *,
        config: dict | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if spec.kind in ("oracle", "pearl"):
            raise UserError(f"policy kind {spec.kind!r} is a replay-only baseline and cannot drive a decoder")
        if spec.kind == "predictor":
            if predictor is None:
                raise ValueError("a 'predictor' policy needs its predictor module: load it from an export folder")
            reads = predictor.feature_spec.kind
            if spec.reads != reads:
                raise UserError(
                    f"policy spec says the predictor reads {spec.reads!r} but family {predictor.family!r} "
                    f"reads {reads!r}: fix 'reads' in the tuned policy spec"
                )
        elif predictor is not None:
            raise ValueError(f"policy kind {spec.kind!r} takes no predictor")
        self.spec = spec
        self.predictor = predictor.to(device).eval() if predictor is not None else None
        self.feature_spec: FeatureSpec | None = predictor.feature_spec if predictor is not None else None
        self.config = dict(config or {})
        self.device = torch.device(device)
        self.decoding = DecodingConfig()
        # Default to the shared vocabulary recorded at export, so standalone use slices the padded
        # logit rows exactly as the dataset did; decoders still set it with configure().
        vocab = ((self.config.get("pair") or {}).get("vocab") or {}).get("shared_vocab_size")
        self.vocab_size: int | None = int(vocab) if vocab else None
        self._by_decoding = []
        if self.config.get("by_decoding") is not None:
            from specstop.export.by_decoding import check_entries

            self._by_decoding = check_entries(self.config["by_decoding"], spec, CONFIG_NAME)
        self.setting: dict | None = self.config.get("decoding") if self._by_decoding else None
        # The price-free statistics of the spec in use (live re-pricing re-picks from them).
        self.stats: dict | None = self.config.get("stats")
        self._round = make_round_policy(spec)
        self._j = 0
        self._batch: list[RoundPolicy] = []
        self._batch_j: list[int] = []
        #: A token-tree export's node head (its ``tree.node_head`` weights), kept so that
        #: ``save_pretrained`` / ``push_to_hub`` write the whole export; None otherwise.
        self.node_head: StoppingPredictor | None = None
        self.last_score: float | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, spec: PolicySpec, predictor: StoppingPredictor | None = None, **kwargs) -> StoppingPolicy:
        return cls(spec, predictor, **kwargs)

    @classmethod
    def from_string(cls, text: str) -> StoppingPolicy:
        """``static:K``, ``heuristic[:START]`` or ``confidence[:TAU]``."""
        return cls(parse_policy_string(text))

    @classmethod
    def for_pair(cls, policy: StoppingPolicy | PolicySpec | str | Path, pair: Any = None, *,
                 allow_draft_mismatch: bool = False) -> StoppingPolicy:
        """The policy a decoder of ``pair`` runs, from any form it is given in - the one parser
        :class:`~specstop.decode.chain.SpeculativeDecoder`, the batched decoder and ``specstop
        decode`` share.

        Args:
            policy: a :class:`StoppingPolicy` (used as is), a rule's :class:`PolicySpec`, a policy
                string (``static:4``, ``heuristic``, ``confidence:0.4``) or an export folder (checked
                against the pair's draft and tokenizer, loaded next to the draft).
            pair: the :class:`~specstop.pair.ModelPair` it will run on (None: no checks).
            allow_draft_mismatch: load an export made for another draft or tokenizer.

        Raises:
            UserError: a malformed string, another type, an export for another draft, or a predictor
                reading hidden states of another size than the draft's.
        """
        identity = getattr(pair, "draft_identity", None)
        if isinstance(policy, StoppingPolicy):
            loaded = policy
        elif isinstance(policy, PolicySpec):
            if policy.kind == "predictor":
                raise UserError(f"policy {policy.label} is a learned predictor: give its export folder instead of its spec")
            loaded = cls.from_spec(policy)
        elif isinstance(policy, (str, Path)):
            loaded = cls.load(
                policy, draft_identity=identity, tokenizer_hash=getattr(pair, "tokenizer_hash", None),
                allow_draft_mismatch=allow_draft_mismatch, device=getattr(pair, "draft_device", "cpu"),
            )
        else:
            raise UserError(
                f"policy must be a StoppingPolicy, a policy string (static:K, heuristic[:START], confidence[:TAU]) or an "
                f"export folder, got {type(policy).__name__}"
            )
        check_policy_inputs(loaded, getattr(identity, "hidden_size", None), str(policy if not isinstance(
            policy, StoppingPolicy) else policy.label))
        return loaded

    @classmethod
    def load(cls, policy: str | Path, **kwargs) -> StoppingPolicy:
        """An export folder (anything that is a directory), a hub id (``owner/name``) or a policy string."""
        if Path(policy).is_dir() or names_hub_repo(str(policy)):
            return cls.from_pretrained(policy, **kwargs)
        return cls.from_string(str(policy))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        draft_identity: Any = None,
        tokenizer_hash: str | None = None,
        allow_draft_mismatch: bool = False,
        device: str | torch.device = "cpu",
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
    ) -> StoppingPolicy:
        """Load an export folder written by ``specstop export`` (or pushed to the Hub).

        Args:
            path: the folder holding ``config.json`` (and ``model.safetensors`` for learned policies),
                or a hub id (``owner/name``; downloaded into the HF cache with ``revision``,
                ``token``, ``cache_dir``, ``local_files_only``, ``force_download``).
            draft_identity: the draft you will run: its name/path, a ``ModelIdentity`` (or dict), or
                None to skip the check.
            tokenizer_hash: your tokenizer's fingerprint (``ModelPair.tokenizer_hash``), or None.
            allow_draft_mismatch: load even when the draft or tokenizer differs (at your own risk:
                the predictor's inputs then come from a model it was not trained on).
            device: where the predictor runs (next to the draft).

        Raises:
            MissingInputError: no config.json / weights.
            UserError: malformed config.json, unknown schema version or format, a weights path
                outside the folder, or weights that do not match the recorded predictor.
            DraftMismatchError: the export was made for another draft or tokenizer.
        """
        folder = resolve_folder(path, revision=revision, token=token, cache_dir=cache_dir,
                                local_files_only=local_files_only, force_download=force_download)
        spec, predictor, config = read_export(
            folder, draft_identity=draft_identity, tokenizer_hash=tokenizer_hash,
            allow_draft_mismatch=allow_draft_mismatch,
        )
        policy = cls(spec, predictor, config=config, device=device)
        head = (config.get("tree") or {}).get("node_head")
        if head is not None:
            policy.node_head = load_predictor_weights(folder, folder / CONFIG_NAME, head).eval()
        return policy

    # ------------------------------------------------------------------ hub (save / push)
    def _save_pretrained(self, save_directory: Path) -> None:
        """Write this policy as an export folder (the layout ``specstop export`` writes; a token tree's
        node head included)."""
        config = self.config or export_config(self.spec, self.predictor, name=self.spec.label)
        if (config.get("tree") or {}).get("node_head") is not None and self.node_head is None:
            raise UserError(f"policy {self.label}: its config names a token-tree node head, and none is loaded; "
                            "load the export with StoppingPolicy.from_pretrained(FOLDER) before saving or pushing it")
        write_export_files(save_directory, config, self.predictor, node_head=self.node_head)

    # ------------------------------------------------------------------ configuration
    def configure(self, decoding: DecodingConfig | None = None, vocab_size: int | None = None) -> StoppingPolicy:
        """Tell the policy how the decoder turns logits into q (features must match training). An export
        tuned per decoding setting switches to the setting that serves ``decoding``
        (:func:`specstop.export.by_decoding.pick`).

        Args:
            decoding: the request's decoding setting; None keeps the current one.
            vocab_size: the shared tokenizer vocabulary; None keeps the current one.

        Raises:
            UserError: ``decoding`` is not a :class:`~specstop.probs.DecodingConfig` (a mapping or a
                transformers ``GenerationConfig`` names the conversion to use).
        """
        if decoding is not None and not isinstance(decoding, DecodingConfig):
            raise UserError(
                f"StoppingPolicy.configure takes a specstop.probs.DecodingConfig, got {type(decoding).__name__}: "
                "build one with DecodingConfig(temperature=..., top_k=..., top_p=...), "
                "DecodingConfig.from_generation({...}) for a mapping, or "
                "specstop.decode.hf_assist.decoding_from_generation_config for a GenerationConfig"
            )
        if decoding is not None:
            self.decoding = decoding
            if self._by_decoding:
                from specstop.export.by_decoding import pick

                entry, spec = self._by_decoding[pick([e for e, _ in self._by_decoding], decoding)]
                # Another setting's policy; the same setting keeps the spec in use (live re-pricing may
                # have moved its threshold).
                if entry["decoding"] != self.setting:
                    self.spec = spec
                    self._round = make_round_policy(spec)
                    self.stats = entry.get("stats")
                self.setting = entry["decoding"]
        if vocab_size is not None:
            self.vocab_size = vocab_size
        return self

    def set_spec(self, spec: PolicySpec) -> StoppingPolicy:
        """Run ``spec`` from the next round on: another threshold, SL_max, rule, K or start of the same
        policy (live re-pricing, :mod:`specstop.decode.live_pricing`). Call it between rounds.

        Raises:
            UserError: ``spec`` is another kind of policy (or reads other inputs) than the one in use.
        """
        if (spec.kind, spec.family, spec.reads) != (self.spec.kind, self.spec.family, self.spec.reads):
            raise UserError(f"cannot switch policy {self.spec.label} to {spec.label}: only its threshold, SL_max, "
                            "rule, K or start may change")
        self.spec = spec
        self._round = make_round_policy(spec)
        if self._batch:  # the batched form: every sequence's next round runs the new spec
            self._batch = [make_round_policy(spec) for _ in self._batch]
            self._batch_j = [0] * len(self._batch)
        return self

    def temperature_mismatch(self, decoding: DecodingConfig) -> str | None:
        """One line for a decoder to warn with when the numbers this policy runs at ``decoding`` were tuned
        on data made at another temperature (the setting :meth:`configure` picks from ``by_decoding``, else
        the export's labels'); None when they match or the policy is a rule built without an export."""
        from specstop.export.by_decoding import pick, setting_of

        setting = (self.config or {}).get("decoding")
        if self._by_decoding:
            setting = self._by_decoding[pick([e for e, _ in self._by_decoding], decoding)][0]["decoding"]
        if setting is None or (isinstance(setting, dict) and setting.get("temperature") is None):
            return None
        t = setting_of(setting, f"{CONFIG_NAME}: decoding")[0]  # the one rule for a recorded setting
        if t == decoding.temperature:
            return None
        return (f"policy {self.label} was tuned on data made at temperature {t:g}, decoding runs at "
                f"{decoding.temperature:g}: its thresholds may not fit (decoding stays lossless; "
                "`specstop export --also-tuned` carries a policy tuned at this temperature)")

    def warn_temperature_mismatch(self, decoding: DecodingConfig, who: str = "") -> str | None:
        """Log :meth:`temperature_mismatch` as specstop's one warning line (the ``specstop`` logger: the CLI
        prints it as ``[specstop] ...``), not as a Python warning with a file, line and source.

        Args:
            decoding: the setting the decoder runs at.
            who: what runs the policy, prefixed to the line (``PEARL's stop``).

        Returns:
            The line logged, or None when the policy was tuned at this temperature.
        """
        mismatch = self.temperature_mismatch(decoding)
        if mismatch:
            import logging

            logging.getLogger(__name__).warning("%s", f"{who} {mismatch}" if who else mismatch)
        return mismatch

    @property
    def label(self) -> str:
        """The export's name (or the rule's label); with a policy per decoding setting, the one in use
        (``disco_ffn @ T=1``)."""
        name = self.config.get("name") or self.spec.label
        if not self._by_decoding:
            return name
        from specstop.export.by_decoding import describe

        return f"{name} @ {describe(self.setting)}"

    @property
    def reads_hidden(self) -> bool:
        """True when the decoder must pass the draft's hidden state (SpecDec++, MCSD hidden)."""
        return self.feature_spec is not None and self.feature_spec.reads_hidden

    @property
    def reads_state(self) -> bool:
        """True when the decision reads the draft state that produced q_j (dist heads ``with_state``)."""
        return self.feature_spec is not None and self.feature_spec.reads_state

    @property
    def needs_hidden(self) -> bool:
        """True when the decoder must ask the draft forward for its hidden states."""
        return self.reads_hidden or self.reads_state

    @property
    def reads_probs(self) -> bool:
        """True when the decision needs q_j (confidence, DISCO, MCSD top-k)."""
        return self.spec.kind == "confidence" or (self.feature_spec is not None and not self.feature_spec.reads_hidden)

    @property
    def hidden_layer(self) -> int:
        return self.feature_spec.hidden_layer if self.feature_spec is not None else -1

    def cap(self) -> int:
        """The policy's own cap on drafted tokens for the coming round (before the remaining-tokens cap)."""
        return self._round.cap()

    # ------------------------------------------------------------------ scoring
    def _probs(self, draft_logits: torch.Tensor | None, draft_probs: torch.Tensor | None) -> torch.Tensor:
        if draft_probs is not None:
            return draft_probs.float()
        if draft_logits is None:
            raise ValueError(f"policy {self.label} reads the draft distribution: pass draft_logits (or draft_probs)")
        return logits_to_probs(draft_logits, self.decoding, self.vocab_size)

    @torch.no_grad()
    def scores(
        self,
        draft_logits: torch.Tensor | None,
        draft_hidden: torch.Tensor | None,
        positions: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Predicted acceptance probabilities for a batch of draft steps.

        Args:
            draft_logits: ``[B, V_model]`` logits q_j was made from (dist predictors).
            draft_hidden: ``[B, H]`` the draft's final hidden state at the last fed token, i.e. after
                y_{j-1}: the state that produced q_j (hidden predictors and ``with_state`` heads).
            positions: ``[B]`` 0-based response positions of y_j.
            draft_probs: ``[B, V]`` q_j already transformed (saves a softmax).

        Returns:
            ``[B]`` float32 sigmoid scores, or None for policies without a predictor.
        """
        if self.predictor is None:
            return None
        fs = self.feature_spec
        if fs.reads_hidden:
            if draft_hidden is None:
                raise ValueError(f"policy {self.label} reads the draft hidden state; draft_hidden is None")
            x = fs.build(hidden=draft_hidden.to(self.device))
        else:
            probs = self._probs(draft_logits, draft_probs).to(self.device)
            state = None
            if fs.reads_state:
                if draft_hidden is None:
                    raise ValueError(f"policy {self.label} reads the draft state that produced q_j; draft_hidden is None")
                state = draft_hidden.to(self.device)
            x = fs.build_from_probs(probs, positions.to(self.device), state)
        return torch.sigmoid(self.predictor(x.float())).float()

    # ------------------------------------------------------------------ batch size 1
    def start_sequence(self) -> None:
        """Start of a new sequence (each ``generate`` call): state carried across rounds - the heuristic
        schedule - starts over from the spec, so a sequence decodes the same whatever came before it
        (as replay assumes, and as interleaved benchmarks need)."""
        self._round = make_round_policy(self.spec)
        self.reset()

    def reset(self) -> None:
        """Start of a round."""
        self._round.reset()
        self._j = 0
        self.last_score = None

    def should_stop(
        self,
        draft_logits: torch.Tensor | None = None,
        draft_hidden: torch.Tensor | None = None,
        position: int = 0,
        *,
        draft_probs: torch.Tensor | None = None,
        draft_token: int | None = None,
    ) -> bool:
        """Decide after drafting token j (j counts calls since :meth:`reset`).

        Args:
            draft_logits: ``[V_model]`` the logits the current token was drawn from (q_j).
            draft_hidden: ``[H]`` the draft's final hidden state at the last fed token (after the
                previous drafted token; at j = 1 after the last emitted one): the state that produced
                q_j. SpecDec++-style hidden heads score it as token j - 1 (nothing at j = 1); dist heads
                ``with_state`` read it with q_j at every step. Pass it whenever ``needs_hidden``.
            position: 0-based response position of the current token.
            draft_probs: ``[V]`` q_j after the decoding transform, if the caller has it already.
            draft_token: the token drafted at this step. Under sampling the confidence rule reads its
                probability q_j(y_j) (as HF's ``assistant_confidence_threshold`` does); greedy drafts
                the argmax, whose probability is the maximum either way.

        Returns:
            True to stop drafting (the policy's own cap included). The caller still enforces the
            remaining-tokens cap and EOS.
        """
        self._j += 1
        j = self._j
        top1, score = 1.0, None
        if self.spec.kind == "confidence":
            probs = self._probs(draft_logits, draft_probs)
            sampled = not self.decoding.greedy and draft_token is not None
            top1 = float(probs[int(draft_token)] if sampled else probs.max())
        elif self.predictor is not None:
            reads_hidden = self.feature_spec.reads_hidden
            # Hidden-state heads score e_{j-1}; at j = 1 there is no drafted y_0 (Algorithm 1 skips it).
            if not reads_hidden or j > 1:
                if reads_hidden and draft_hidden is None:
                    raise ValueError(
                        f"policy {self.label} reads the hidden state of the previous drafted token; "
                        "pass draft_hidden for every step after the first"
                    )
                s = self.scores(
                    None if draft_logits is None else draft_logits.unsqueeze(0),
                    None if draft_hidden is None else draft_hidden.reshape(1, -1),
                    torch.tensor([position]),
                    None if draft_probs is None else draft_probs.unsqueeze(0),
                )
                score = float(s[0])
        self.last_score = score
        return self._round.should_stop(StepFeatures(j=j, position=position, top1=top1, score=score))

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        """After verification (the heuristic schedule learns from it)."""
        self._round.end_round(num_drafted, num_accepted)

    @property
    def cumulative_acceptance(self) -> float:
        """SpecDec++'s running product of predicted acceptances in this round."""
        return self._round.cumulative_acceptance

    # ------------------------------------------------------------------ batched form
    def reset_batch(self, batch_size: int | None = None, mask: torch.Tensor | Sequence[bool] | None = None) -> None:
        """(Re)start rounds. With ``batch_size`` a fresh set of B state machines is made (the heuristic
        schedule starts over); with ``mask`` only the selected sequences start a new round."""
        if batch_size is not None:
            self._batch = [make_round_policy(self.spec) for _ in range(batch_size)]
            self._batch_j = [0] * batch_size
            return
        if not self._batch:
            raise RuntimeError("call reset_batch(batch_size=B) before the first batched round")
        for b, m in enumerate(_as_bools(mask, len(self._batch))):
            if m:
                self._batch[b].reset()
                self._batch_j[b] = 0

    @torch.no_grad()
    def should_stop_batch(
        self,
        draft_logits: torch.Tensor | None,
        draft_hidden: torch.Tensor | None,
        positions: torch.Tensor | Sequence[int],
        *,
        active: torch.Tensor | Sequence[bool] | None = None,
        draft_probs: torch.Tensor | None = None,
        draft_tokens: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Batched :meth:`should_stop` with one state machine per sequence.

        Args:
            draft_logits: ``[B, V_model]``; draft_hidden: ``[B, H]`` or None (all at j = 1).
            positions: ``[B]`` response positions of the current tokens.
            active: ``[B]`` bools; inactive sequences (already stopped) keep their state and get True.
            draft_probs: ``[B, V]`` transformed q, optional.
            draft_tokens: ``[B]`` drafted tokens (sampling: the confidence rule reads their probability).

        Returns:
            ``BoolTensor[B]``: stop drafting for that sequence.
        """
        B = len(self._batch)
        if B == 0:
            raise RuntimeError("call reset_batch(batch_size=B) before should_stop_batch")
        act = _as_bools(active, B)
        positions = torch.as_tensor(positions).reshape(-1)
        for b in range(B):
            if act[b]:
                self._batch_j[b] += 1
        top1 = [1.0] * B
        score: list[float | None] = [None] * B
        if self.spec.kind == "confidence":
            probs = self._probs(draft_logits, draft_probs)
            if not self.decoding.greedy and draft_tokens is not None:
                idx = torch.as_tensor(draft_tokens, device=probs.device).reshape(-1, 1).long()
                top1 = probs.gather(-1, idx).squeeze(-1).tolist()
            else:
                top1 = probs.max(-1).values.tolist()
        elif self.predictor is not None:
            if self.feature_spec.reads_hidden and draft_hidden is None:
                if any(act[b] and self._batch_j[b] > 1 for b in range(B)):
                    raise ValueError("hidden-state policy: draft_hidden is required once any sequence is past j = 1")
            else:
                s = self.scores(draft_logits, draft_hidden, positions, draft_probs).tolist()
                # Hidden-state heads have no score at j = 1 (the state of y_0 is not a drafted token).
                score = [None if (self.feature_spec.reads_hidden and self._batch_j[b] <= 1) else s[b] for b in range(B)]
        out = torch.ones(B, dtype=torch.bool)
        for b in range(B):
            if act[b]:
                step = StepFeatures(j=self._batch_j[b], position=int(positions[b]), top1=top1[b], score=score[b])
                out[b] = self._batch[b].should_stop(step)
        return out

    def end_round_batch(self, num_drafted: Sequence[int], num_accepted: Sequence[int], mask=None) -> None:
        for b, m in enumerate(_as_bools(mask, len(self._batch))):
            if m:
                self._batch[b].end_round(int(num_drafted[b]), int(num_accepted[b]))

    def cap_batch(self) -> list[int]:
        return [p.cap() for p in self._batch]

    def __repr__(self) -> str:
        return f"StoppingPolicy({self.label})"


def _as_bools(mask, n: int) -> list[bool]:
    if mask is None:
        return [True] * n
    vals = [bool(v) for v in (mask.tolist() if isinstance(mask, torch.Tensor) else mask)]
    if len(vals) != n:
        raise ValueError(f"mask has {len(vals)} entries for a batch of {n}")
    return vals
