"""Grammar helpers of the tests: one agentic layer parsed as a whole (the package's turn
validation reads `parse_layer_members`, routes and errors together)."""

from __future__ import annotations

from jax_routeweaver.routing.protocol.grammar import AgenticRoute, Rejected, parse_layer_members


def parse_layer(text: str) -> tuple[AgenticRoute, ...] | Rejected:
    """Every `<route …>…</route>` of an agentic turn, as one layer (parse-level checks only;
    `validate_layer` applies the episode rules): its routes, or `Rejected` with its errors."""
    routes, errors = parse_layer_members(text)
    return Rejected(errors) if errors else routes
