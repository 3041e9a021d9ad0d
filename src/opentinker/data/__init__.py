"""The data path shared by SFT and RL: token sequences with per-token masks -> ``tinker.types.Datum``."""

from opentinker.data.datum import datum_from_tokens, supervised_datum

__all__ = ["datum_from_tokens", "supervised_datum"]
