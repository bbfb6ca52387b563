"""Profile handlers: which profiles run for a request, and which one is primary.

| type | behaviour |
|---|---|
| `single-profile-handler` | runs the only profile (or the one named `default`); it is primary |
| `pd-profile-handler` | prefill/decode disaggregation: runs `decode` (primary), then `prefill` when the prompt's uncached part on the chosen decode endpoint is long enough; names it the result's prefill profile |

`pd-profile-handler` parameters (defaults):
- `decodeProfile` (`decode`), `prefillProfile` (`prefill`): the profiles to run; give each its
  role filter (`decode-filter`, `prefill-filter`) and, to prefer compute-rich hardware for
  prefill and bandwidth-rich hardware for decode, `hardware-class-scorer` with `phase: prefill`
  and `phase: decode` respectively.
- `nonCachedTokens` (0): disaggregate when the prompt tokens *not* cached on the chosen decode
  endpoint are at least this many; 0 never disaggregates.
- `always` (false): disaggregate every request (llm-d's `always-disagg-pd-decider`).
- `minPromptTokens` (0): and only when the prompt has at least this many tokens.
- `charsPerToken` (4.0): the token estimate when no tokenizer ran.

Cached tokens come from the `prefix-cache-scorer` in the decode profile (without one, nothing
counts as cached). When the prefill profile finds no endpoint (no prefill pool, or all filtered
out), the request is served aggregated by the decode endpoint rather than failed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from kv_picker.decode import NonNegative, Positive
from kv_picker.endpoint import Endpoint
from kv_picker.errors import SaturatedError
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest, ProfileRunner, SchedulingResult
from kv_picker.scheduling.signals import cached_tokens, prompt_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SingleProfileParams:
    profile: str = ""  # empty: the only profile, or `default` when there are several


class SingleProfileHandler:
    type_name: ClassVar[str] = "single-profile-handler"
    Params = SingleProfileParams

    def __init__(self, name: str, params: SingleProfileParams, ctx: BuildContext) -> None:
        self.name = name
        self._profile = params.profile

    def required_profiles(self) -> tuple[str, ...]:
        return (self._profile,) if self._profile else ()

    def schedule(
        self,
        request: LLMRequest,
        candidates: list[Endpoint],
        profile_names: Sequence[str],
        run_profile: ProfileRunner,
    ) -> SchedulingResult:
        profile = self._profile or (profile_names[0] if len(profile_names) == 1 else "default")
        return SchedulingResult(profile, {profile: run_profile(profile, request, candidates)})


@dataclass(frozen=True)
class PDProfileParams:
    decodeProfile: str = "decode"
    prefillProfile: str = "prefill"
    nonCachedTokens: Annotated[int, NonNegative] = 0
    minPromptTokens: Annotated[int, NonNegative] = 0
    charsPerToken: Annotated[float, Positive] = 4.0
    always: bool = False

    def validate(self) -> None:
        if self.decodeProfile == self.prefillProfile:
            raise ValueError("'decodeProfile' and 'prefillProfile' must differ")


class PDProfileHandler:
    type_name: ClassVar[str] = "pd-profile-handler"
    Params = PDProfileParams

    def __init__(self, name: str, params: PDProfileParams, ctx: BuildContext) -> None:
        self.name = name
        self.params = params
        self.disaggregated = 0
        self.aggregated = 0
        self.prefill_unavailable = 0

    def required_profiles(self) -> tuple[str, ...]:
        return (self.params.decodeProfile, self.params.prefillProfile)

    def schedule(
        self,
        request: LLMRequest,
        candidates: list[Endpoint],
        profile_names: Sequence[str],
        run_profile: ProfileRunner,
    ) -> SchedulingResult:
        params = self.params
        decode = run_profile(params.decodeProfile, request, candidates)
        result = SchedulingResult(params.decodeProfile, {params.decodeProfile: decode})
        if not self._should_disaggregate(request, decode.targets[0]):
            self.aggregated += 1
            return result
        try:
            prefill = run_profile(params.prefillProfile, request, candidates)
        except SaturatedError as exc:
            log.debug("no prefill endpoint, serving aggregated: %s", exc)
            self.prefill_unavailable += 1
            return result
        result.profile_results[params.prefillProfile] = prefill
        result.prefill_profile = params.prefillProfile
        self.disaggregated += 1
        return result

    def _should_disaggregate(self, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
        params = self.params
        if params.always:
            return True
        if params.nonCachedTokens == 0:
            return False
        total = prompt_tokens(request, params.charsPerToken)
        if total < params.minPromptTokens:
            return False
        uncached = total - cached_tokens(request, decode_endpoint.id)
        return uncached >= params.nonCachedTokens


BUILTIN_PROFILE_HANDLERS = (SingleProfileHandler, PDProfileHandler)
