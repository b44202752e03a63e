"""Answer scorers, one per `scorer_dataset` name (the original's dataset-to-scorer mapping),
found through `registry`.

`math_equiv` (symbolic math), `text` (letter, SAT/UNSAT, alias EM, short-answer EM and
containment) and `code` (programs run against tests in the sandbox) register themselves;
`registry.get_scorer(name)` loads them on first use.
"""
