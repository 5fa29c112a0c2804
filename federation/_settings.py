"""The gossip settings and their rules: one definition, for the Federation and the daemon's config.

A member gossips every `gossip_interval_s` with `fanout` live peers, each exchange bounded by
`request_timeout_s`; a peer silent for `suspect_after_s` is suspect, for `dead_after_s` dead.
So the durations must be positive and finite, and interval < suspect_after_s < dead_after_s:
a member is heard from at most once per interval, and death must come after suspicion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._exceptions import FederationSettingError

_DURATIONS = ("gossip_interval_s", "suspect_after_s", "dead_after_s", "request_timeout_s")


@dataclass(frozen=True, slots=True)
class GossipSettings:
    """Valid gossip timing; constructing one raises FederationSettingError naming the setting."""

    gossip_interval_s: float = 1.0
    fanout: int = 3
    suspect_after_s: float = 5.0
    dead_after_s: float = 15.0
    request_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in _DURATIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FederationSettingError(name, f"must be a number of seconds, not {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise FederationSettingError(name, f"must be a positive, finite number of seconds, not {value!r}")
        if isinstance(self.fanout, bool) or not isinstance(self.fanout, int) or self.fanout < 1:
            raise FederationSettingError("fanout", f"must be a whole number of peers, at least 1, not {self.fanout!r}")
        if self.suspect_after_s <= self.gossip_interval_s:
            raise FederationSettingError(
                "suspect_after_s",
                f"must be greater than gossip_interval_s ({self.gossip_interval_s:g}), "
                f"not {self.suspect_after_s:g}",
                other="gossip_interval_s",
            )
        if self.dead_after_s <= self.suspect_after_s:
            raise FederationSettingError(
                "dead_after_s",
                f"must be greater than suspect_after_s ({self.suspect_after_s:g}), "
                f"not {self.dead_after_s:g}",
                other="suspect_after_s",
            )
