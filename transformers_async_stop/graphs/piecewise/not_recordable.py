"""The exception a refused recording raises (`recorder.py`, `encoder_decoder_sites.py`); `graphs.record` lets the
step run again eagerly, its message the reason `last_path()` names."""


class NotRecordable(Exception):
    """The forward did something a replay could not reproduce; the reason is the message."""
