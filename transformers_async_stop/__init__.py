"""Make HuggingFace `model.generate()` stop waiting on the GPU.

    import transformers_async_stop
    model.generate(input_ids, async_stopping_criteria=True)

Importing applies the patches (see `targets/` for the list); `unpatch()` restores stock transformers, also for
configs and models created while patched. `last_path()` says which path the last call that asked for the flag took.
"""

from .config import FORCE_ENV, StockPathWarning
from .undo.module_state import passive_hook
from .patching import apply, is_patched, skipped, unpatch
from .path_report import CallPath, last_path
from .release_checks.release_notice import NewerReleaseWarning
from .loops.static_loop import graph_safe

__version__ = "0.2.0"
__all__ = ["apply", "unpatch", "is_patched", "skipped", "graph_safe", "passive_hook", "last_path", "CallPath", "StockPathWarning",
           "NewerReleaseWarning", "FORCE_ENV", "__version__"]

apply()
