"""The controller: the one-step-late stop verdict of a decoding loop, and what hands it to stock code.

- `controller.py`: `AsyncStop`, the verdict copied to the host while the next step runs, and the extra step it undoes;
- `stop_check.py`: transformers 5.17+'s `DeferredStopCheck`, subclassed so `_sample` uses the controller;
- `step_lists.py`: the call's processors, criteria and streamer as the deferred loop hands them to stock code;
- `peers.py`: `synced_gpus=True`, the peers' "is anyone still running?" read one call late.
"""
