"""The protocol's codes: every `Violation` a router turn can commit, grouped by the kind of turn
that checks it, and the non-terminal `Notice` records (docs/protocol.md, "Violation codes",
"How an episode ends").

With `ProtocolConfig.recovery` off (the original's default) the first violation ends the
episode; with it on the runner injects `violation_cue` text and the policy retries.
"""

from __future__ import annotations

import enum


# ------------------------------------------------------------------------------- violations
class Violation(enum.StrEnum):
    """Every policy violation of the live path (docs/protocol.md, "Violation codes"). Terminal
    unless recovery is on."""

    # selector turn (docs/protocol.md, "Selector turn")
    SELECTOR_MODE_MISSING = "selector_mode_missing"  # no <mode>x</mode> in the selector turn
    SELECTOR_MODE_DUPLICATE = "selector_mode_duplicate"  # two or more declarations
    SELECTOR_MODE_INVALID = "selector_mode_invalid"  # one declaration, value not a mode
    ROUTE_IN_SELECTOR = "route_in_selector"  # <route in the selector turn
    LAYER_IN_SELECTOR = "layer_in_selector"  # <layer in the selector turn
    ACTION_IN_SELECTOR = "action_in_selector"  # <action in the selector turn
    PARADIGM_IN_SELECTOR = "paradigm_in_selector"  # <paradigm in the selector turn
    OBSERVATION_IN_SELECTOR = "observation_in_selector"  # <observation in the selector turn
    ANSWER_IN_SELECTOR = "answer_in_selector"  # <answer in the selector turn
    # single / multi action turn (docs/protocol.md, "Single/multi action turn"), in check order
    MODE_DUPLICATE = "mode_duplicate"  # any <mode opening tag in an action turn
    ANSWER_PREMATURE = "answer_premature"  # <answer> before the required number of calls
    ROUTE_MISSING = "route_missing"  # no route and no <route opening at all
    ROUTE_MALFORMED = "route_malformed"  # unclosed <route, or stray text among attributes
    ATTR_DUPLICATE = "attr_duplicate"  # an attribute name given twice
    ATTR_UNKNOWN = "attr_unknown"  # an attribute other than model (role, refs, id, ...)
    ATTR_MISSING = "attr_missing"  # no model attribute, or an empty one
    QUERY_EMPTY = "query_empty"  # empty route body
    PLACEHOLDER = "placeholder"  # model="MODEL_ID", or a template placeholder as the task
    ROUTE_LIMIT_EXCEEDED = "route_limit_exceeded"  # a route after the mode's last allowed call
    UNKNOWN_MODEL = "unknown_model"  # model id not in the worker registry (aliases only)
    WORKER_NOT_OFFERED = "worker_not_offered"  # registered id not offered to this run
    # agentic action turn (docs/protocol.md, "Agentic action turn"): parse level
    ACTION_MISSING = "action_missing"  # no complete route and no <route (a bare <answer> too)
    ACTION_MALFORMED = "action_malformed"  # <route present but no complete route
    ROLE_MISSING = "role_missing"  # a member without role (or role="")
    MODEL_MISSING = "model_missing"  # a member without model (or an empty one)
    INSTRUCTION_MISSING = "instruction_missing"  # a member with an empty body
    # agentic: per member
    ROLE_INVALID = "role_invalid"  # role not planner/executor/verifier/summarizer
    MODEL_INVALID = "model_invalid"  # model not an offered id (exact, case-sensitive)
    REF_UNKNOWN = "ref_unknown"  # a ref that names no completed node
    REF_SAME_LAYER = "ref_same_layer"  # a ref to a node this very layer would create
    SUMMARIZER_NEEDS_REFS = "summarizer_needs_refs"  # summarizer with refs="" once nodes exist
    VERIFIER_NEEDS_REFS = "verifier_needs_refs"  # verifier with refs="" (always)
    ALREADY_FINISHED = "already_finished"  # any route after the summarizer ran
    # agentic: whole layer
    LAYER_EXCEEDS_BUDGET = "layer_exceeds_budget"  # more members than calls remaining
    MUST_SUMMARIZE_NOW = "must_summarize_now"  # no summarizer, and no slot would be left for it
    SUMMARIZER_NOT_ALONE = "summarizer_not_alone"  # summarizer with siblings in its layer
    DUPLICATE_IN_LAYER = "duplicate_in_layer"  # two members with equal (role, model, task)


# The enum is declared surface by surface, so the surfaces are slices of it.
SELECTOR_VIOLATIONS: tuple[Violation, ...] = tuple(list(Violation)[:9])
SINGLE_MULTI_VIOLATIONS: tuple[Violation, ...] = tuple(list(Violation)[9:21])
AGENTIC_VIOLATIONS: tuple[Violation, ...] = tuple(list(Violation)[21:])


class Notice(enum.StrEnum):
    """Non-terminal records (docs/protocol.md, "How an episode ends"); they never end an
    episode or cost reward by themselves."""

    FABRICATED_OBSERVATION_BLOCKED = "fabricated_observation_blocked"  # policy wrote <observation
    RULES_BUDGET_EXHAUSTED = "rules_budget_exhausted"  # rulebook did not fit the window
    OBS_BUDGET_EXHAUSTED = "obs_budget_exhausted"  # observation budget 0: the episode stops
    WORKER_SPAN_EXTRACTION_FAILED = "worker_span_extraction_failed"  # (worker exploration only)
