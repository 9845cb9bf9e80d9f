"""What crosses hosts: the typed encoding of the messages (`codec.py`) and the CurveZMQ keys
and sockets that authenticate both ends (`keys.py`). Nothing on these sockets is pickled."""
