"""Hypothesis strategies for suite-model dimensions, composed from small named pieces.

Sizes stay modest so that one example compiles and runs on a CPU in well under a second,
and they lean toward the sizes that break fused kernels: 1, powers of two and their
neighbours, where a tile is full, empty, or one element over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from fuseguard.suites.models import Dims, SuiteModel

MAX_SEED = 2**32 - 1


def tile_edges(lo: int, hi: int) -> list[int]:
    """Sizes in [lo, hi] at tile boundaries: the ends, 2^k and 2^k +- 1."""
    edges = {lo, hi}
    power = 1
    while power <= hi + 1:
        edges.update({power - 1, power, power + 1})
        power *= 2
    return sorted(e for e in edges if lo <= e <= hi)


def _edge_biased(lo: int, hi: int) -> st.SearchStrategy[int]:
    """An integer in [lo, hi], drawn from tile edges half of the time; shrinks toward ``lo``."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got [{lo}, {hi}]")
    return st.one_of(st.sampled_from(tile_edges(lo, hi)), st.integers(lo, hi))


def batch_sizes(max_batch: int = 2, min_batch: int = 1) -> st.SearchStrategy[int]:
    """Batch sizes; small by default since batch adds run time but rarely new kernel shapes."""
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, got [{min_batch}, {max_batch}]")
    return st.integers(min_batch, max_batch)


def seq_lens(max_len: int, min_len: int = 1) -> st.SearchStrategy[int]:
    """Sequence lengths (or token counts) in [min_len, max_len], biased to tile edges."""
    return _edge_biased(min_len, max_len)


def image_sizes(min_size: int, max_size: int) -> st.SearchStrategy[int]:
    """Square image side lengths in [min_size, max_size], biased to tile edges."""
    return _edge_biased(min_size, max_size)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for weights and inputs (numpy accepts any non-negative int; keep to 32 bits)."""
    return st.integers(0, MAX_SEED)


_DIM_PIECES: dict[str, Callable[[int, int], st.SearchStrategy[int]]] = {
    "batch": lambda lo, hi: batch_sizes(hi, lo),
    "seq": lambda lo, hi: seq_lens(hi, lo),
    "tokens": lambda lo, hi: seq_lens(hi, lo),
    "size": image_sizes,
}
"""Which piece draws a dim of a given name; any other dim is a plain integer in its range."""


def dim_values(dim: str, lo: int, hi: int) -> st.SearchStrategy[int]:
    """Values for one named dim within [lo, hi]."""
    piece = _DIM_PIECES.get(dim)
    return piece(lo, hi) if piece is not None else st.integers(lo, hi)


def dims_for(model: SuiteModel) -> st.SearchStrategy[Dims]:
    """Dims dicts for ``model``: every dim it takes, each within its ``dim_ranges``."""
    return st.fixed_dictionaries({
        dim: dim_values(dim, *model.dim_ranges[dim]) for dim in model.default_dims
    })


def model_cases(models: Sequence[SuiteModel]) -> st.SearchStrategy[tuple[SuiteModel, Dims, int]]:
    """(model, dims, seed) triples over ``models``: one draw is one build-and-compare case."""
    if not models:
        raise ValueError("model_cases needs at least one model")
    return st.sampled_from(list(models)).flatmap(
        lambda model: st.tuples(st.just(model), dims_for(model), seeds())
    )


def dag_recipes(family: str | None = None, max_steps: int = 8) -> st.SearchStrategy:
    """Random DAG recipes (suites/dags.py) over the pattern ops: each step reads earlier values, and
    operands lean to recent values and to value 0 so that fan-out and residual reconvergence are common."""
    from fuseguard.suites.dags import FAMILIES, Recipe

    if max_steps < 1:
        raise ValueError(f"need max_steps >= 1, got {max_steps}")
    families = [family] if family is not None else sorted(FAMILIES)

    @st.composite
    def draw(draw_fn) -> Recipe:
        fam = draw_fn(st.sampled_from(families))
        ops = FAMILIES[fam]
        n = draw_fn(st.integers(1, max_steps))
        steps = []
        for i in range(n):
            op = draw_fn(st.sampled_from(sorted(ops)))
            operands = tuple(draw_fn(st.one_of(st.just(i), st.integers(max(0, i - 2), i), st.integers(0, i)))
                             for _ in range(ops[op]))
            steps.append((op, operands))
        return Recipe(fam, tuple(steps))

    return draw()
