"""Layer 1 of ``gefen.core``: pure math kernels with no optimizer object (docs/core.md §1).

Every function here is pure: it reads tensors and Python scalars, returns new tensors, and
modifies none of its inputs. The eager implementations in this package are normative; faster
implementations must match them.
"""

from gefen.core.kernels.binning import BIN_COUNT, bin_centres, histogram
from gefen.core.kernels.period import (
    MIN_SEARCHED_PERIOD,
    candidate_divisors,
    decide_period,
    fallback,
    period_errors,
    row_period,
    select_period,
)
from gefen.core.kernels.quantize import (
    mix64,
    nearest_index,
    stochastic_index,
    stream_seed,
    uniform_draws,
)
from gefen.core.kernels.solver import pad_codebook, solve_codebook, solve_optimal
from gefen.core.kernels.update import (
    FLT_MIN,
    BlockUpdate,
    CodebookMomentum,
    DenseMomentum,
    FactoredUpdate,
    Momentum,
    factored_second_moment,
    floored_second_moment,
    nesterov_momentum,
    update_block,
    update_factored,
)

__all__ = [
    "BIN_COUNT",
    "FLT_MIN",
    "MIN_SEARCHED_PERIOD",
    "BlockUpdate",
    "CodebookMomentum",
    "DenseMomentum",
    "FactoredUpdate",
    "Momentum",
    "bin_centres",
    "candidate_divisors",
    "decide_period",
    "factored_second_moment",
    "fallback",
    "floored_second_moment",
    "histogram",
    "mix64",
    "nearest_index",
    "nesterov_momentum",
    "pad_codebook",
    "period_errors",
    "row_period",
    "select_period",
    "solve_codebook",
    "solve_optimal",
    "stochastic_index",
    "stream_seed",
    "uniform_draws",
    "update_block",
    "update_factored",
]
