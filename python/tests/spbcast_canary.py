"""Imported only when a test means it: a root naming this module must not make a follower import
it (test_values.py checks sys.modules), unless the follower allowed it with allow_modules."""

import os

os.environ["SPBCAST_CANARY_IMPORTED"] = "1"


class Canary:
    pass
