import os
import warnings

# The CPU suite exercises the one-step-late path: on CPU it only runs when forced.
os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
