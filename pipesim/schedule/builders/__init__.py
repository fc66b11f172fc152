"""One module per schedule family; importing them registers the builders."""
from . import simple  # noqa: F401  gpipe, 1f1b, looped-bfs
