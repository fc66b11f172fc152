"""One module per schedule family; importing them registers the builders. (zb-auto, a search
that simulates its candidates, registers from :mod:`pipesim.zb_auto`: schedule/ never imports
the simulator.)"""
from . import simple  # noqa: F401  gpipe, 1f1b, looped-bfs
from . import interleaved  # noqa: F401  Megatron interleaved 1F1B
from . import zero_bubble  # noqa: F401  zb-h1, zb-h2
from . import zbv  # noqa: F401  ZB-V
from . import dualpipe  # noqa: F401  DualPipeV
from . import dualpipe_bidirectional  # noqa: F401  DualPipe (two directions, tied copies)
from . import controllable  # noqa: F401  v-half, v-min
