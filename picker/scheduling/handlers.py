"""Profile handlers: which profiles run for a request, and which one is primary.

| type | behaviour |
|---|---|
| `single-profile-handler` | runs the only profile (or the one named `default`); it is primary |

The prefill/decode handler builds on the same contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from picker.scheduling.types import BuildContext, LLMRequest, ProfileRunner, SchedulingResult
from picker.state.endpoints import Endpoint


@dataclass(frozen=True)
class SingleProfileParams:
    profile: str = ""  # empty: the only profile, or `default` when there are several


class SingleProfileHandler:
    type_name: ClassVar[str] = "single-profile-handler"
    Params = SingleProfileParams

    def __init__(self, name: str, params: SingleProfileParams, ctx: BuildContext) -> None:
        self.name = name
        self._profile = params.profile

    def schedule(
        self,
        request: LLMRequest,
        candidates: list[Endpoint],
        profile_names: Sequence[str],
        run_profile: ProfileRunner,
    ) -> SchedulingResult:
        profile = self._profile or (profile_names[0] if len(profile_names) == 1 else "default")
        return SchedulingResult(profile, {profile: run_profile(profile, request, candidates)})


BUILTIN_PROFILE_HANDLERS = (SingleProfileHandler,)
