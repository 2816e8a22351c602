"""The built-in passes in pipeline order, each with its stage.

`PASSES` is the one list: the default pipeline is all of it in order, the
normalizing prefix is its `NORMALIZING` stage, and `explain()` reads its
`FUSION` stage. Importing this module registers every built-in pass (each
names itself: `Pass.name`).
"""

from __future__ import annotations

import enum

from tiledsl.passes.canonicalize import Canonicalize
from tiledsl.passes.cse import CSE
from tiledsl.passes.dce import DCE
from tiledsl.passes.distribute_matmul import DistributeMatmul
from tiledsl.passes.fuse_attention import FuseAttention
from tiledsl.passes.fuse_attention_backward import FuseAttentionBackward
from tiledsl.passes.fuse_elementwise import FuseElementwise
from tiledsl.passes.fuse_epilogue import FuseEpilogue
from tiledsl.passes.fuse_horizontal import FuseHorizontal
from tiledsl.passes.fuse_rows import FuseRows
from tiledsl.passes.fuse_scatter import FuseScatter
from tiledsl.passes.hoist_row_scale import HoistRowScale
from tiledsl.passes.lower_kernels import LowerKernels
from tiledsl.passes.online_softmax import OnlineSoftmax
from tiledsl.passes.own_prologues import OwnPrologues
from tiledsl.passes.recompute import Recompute
from tiledsl.passes.registry import Pass
from tiledsl.passes.sink_reshape import SinkReshape
from tiledsl.passes.sink_transposes import SinkTransposes
from tiledsl.passes.sum_precision import SumPrecision
from tiledsl.passes.widen_score_sums import WidenScoreSums


class Stage(str, enum.Enum):
    # rewrites into the algebra the fusions recognise, changing no result (but the NaN of a
    # written-out softmax's all -inf row, which becomes 0): what autodiff differentiates
    NORMALIZING = "normalizing"
    # decisions about which ops share a kernel: values recomputed by their readers, kernels
    # formed, independent kernels merged
    FUSION = "fusion"
    # every op left becomes a kernel of its own; runs last
    LOWERING = "lowering"

    def __str__(self) -> str:
        return self.value


PASSES: tuple[tuple[type[Pass], Stage], ...] = (
    (Canonicalize, Stage.NORMALIZING),
    (SinkReshape, Stage.NORMALIZING),
    (CSE, Stage.NORMALIZING),
    (DCE, Stage.NORMALIZING),
    (OnlineSoftmax, Stage.NORMALIZING),
    (DistributeMatmul, Stage.NORMALIZING),
    (HoistRowScale, Stage.NORMALIZING),
    (SumPrecision, Stage.FUSION),
    (Recompute, Stage.FUSION),
    (FuseAttention, Stage.FUSION),
    (WidenScoreSums, Stage.FUSION),
    (OwnPrologues, Stage.FUSION),
    (SinkTransposes, Stage.FUSION),
    (FuseAttentionBackward, Stage.FUSION),
    (FuseEpilogue, Stage.FUSION),
    (FuseRows, Stage.FUSION),
    (FuseScatter, Stage.FUSION),
    (FuseElementwise, Stage.FUSION),
    (FuseHorizontal, Stage.FUSION),
    (LowerKernels, Stage.LOWERING),
)


def stage_passes(stage: Stage) -> tuple[str, ...]:
    """The names of the passes of one stage, in pipeline order."""
    return tuple(cls.name for cls, s in PASSES if s is stage)


DEFAULT_PIPELINE = ",".join(cls.name for cls, _ in PASSES)
NORMALIZING = stage_passes(Stage.NORMALIZING)
FUSION = stage_passes(Stage.FUSION)
