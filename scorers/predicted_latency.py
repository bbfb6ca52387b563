"""predicted-latency-scorer: one estimate of time to first token, from cache, load and hardware.

Type: ``predicted-latency-scorer``

Formula, per candidate endpoint ``e`` of hardware class ``c`` (prefill work is compute, scaled
by the class's prefill speed; step overheads are memory reads, scaled by its decode speed):

```
n(e), k(e)    = the request's uncached and cached prompt tokens on e  (from the prefix match)
work(n, k)    = n / R  +  n * (k + n/2) / (R * A)          # linear layers + causal attention
own_s(e)      = work(n(e), k(e)) / c.prefill_speed
queued_s(e)   = (Q_tokens(e) / R + Q_pairs(e) / (R * A)) / c.prefill_speed
steps(e)      = ceil((Q_tokens(e) + n(e)) / chunkTokens)    # engine steps until the first token
step_s(e)     = (stepSeconds + F(e) / kvReadTokensPerSecond) / c.decode_speed
other_s(e)    = max(0, waiting(e) - Q_requests(e)) * queuedRequestSeconds / c.prefill_speed
slot_s(e)     = max(0, I(e) + 1 - maxNumSeqs) * L(e) / maxNumSeqs
ttft(e)       = queued_s + own_s + steps * step_s + other_s + slot_s
                (+ transferSecondsPerToken * n)
score(e)      = min_e' ttft(e') / ttft(e)                   # the fastest candidate scores 1
```

with ``R`` = ``prefillTokensPerSecond``, ``A`` = ``attentionCrossoverTokens`` (the context
length at which a token's attention costs as much as its linear layers; 0 = no attention term),
``Q_tokens``, ``Q_pairs``, ``Q_requests`` the uncached tokens, their attention work and the
requests this picker sent to ``e`` whose prefill has not finished (counted from the pick to the
first response byte), ``F`` the prompt tokens of the requests in flight on ``e`` (the KV each
decode step reads), ``I`` the requests in flight on ``e``, and ``L`` how long a request on ``e``
lasts (a moving average from the pick to the response's end over the last twenty or so;
``outputTokens * step_s`` before any has ended). Work is counted in tokens, not
requests: a 100,000-token prompt ahead in the queue delays a new one far more than a
1,000-token one, and a long context costs more than its length (attention).

``remotePrefillTokens`` is for the decode profile of a P/D configuration, set to the
``pd-profile-handler``'s ``nonCachedTokens``. A request with at least that many tokens uncached
on ``e`` is prefilled on a prefill endpoint and its KV sent to ``e``, so there it costs no
prefill work and no queued prefill ahead of it:

```
ttft(e)       = step_s + other_s + slot_s  (+ transferSecondsPerToken * n)
```

Without it, the decode profile counts the uncached prompt as prefill on the decode endpoint and
keeps each context's decode on the endpoint holding it. The built-in P/D configurations of the
benchmarks do not set it: on the routing matrix's tuning families it passes more P/D cells per
draw and one fewer pooled over three draws (``benchmarks/RESULTS.md`` §1).

``decodeTokens`` (0: off) adds the request's own first output tokens to the estimate, each
step reading the KV in flight on ``e`` plus the request's own prompt:

```
decode_s(e)   = decodeTokens * (stepSeconds + (F(e) + n(e) + k(e)) / kvReadTokensPerSecond)
                / c.decode_speed
```

The time to the first token alone says an endpoint that holds a long context is the place for
every question about it, however many of those contexts it is already decoding; each of them
slows every decode step there, so the last requests of a burst finish late. With this term the
estimate is the time to the ``decodeTokens``-th token, and a busy holder loses to an idle
endpoint once its slower steps cost more than prefilling the context elsewhere.

Two options shape that term. ``decodeMinPromptTokens`` (0) counts it only for a request whose
prompt has at least that many tokens. ``decodeExcess`` (off) adds to the ranking only what the
term exceeds at the candidate where it is least:

```
cost(e)       = ttft(e) + decode_s(e) - min_e' decode_s(e')
```

Added as is, most of the term is the same at every candidate (the step overhead and the
request's own prompt read at each step), so it pulls every ratio toward 1 and hands the
choice to the other scorers even where no endpoint is busy; in excess, an idle pool adds
nothing and a holder pays only for the decode it already runs. Over every prompt, the excess
moves requests off endpoints holding hot short prefixes, which then prefill them again
elsewhere (``decodeTokens: 150`` on the routing matrix's tuning families, draws 1-3: 108 cells
against the default's 123). The built-in default sets ``decodeTokens: 64`` and
``decodeExcess``, chosen on draws 1-3 of the routing matrix and confirmed on draws 16-18, which no
choice had seen, by a rule written before they ran (``benchmarks/RESULTS.md`` section 1), from
``decodeMinPromptTokens: 32768`` then (the prefix match's 2,048 blocks: a longer context held
whole looks free with the prefix scorer's ``cappedMatchIsWhole``) and from 8,192 since the
calibrated estimate at weight 1.5 joined it (confirmed on draws 67-69, below).

``decodeShortTokens`` (0: off; needs ``decodeMinPromptTokens``) counts that many of a shorter
prompt's first decode steps where it counted none. With hot short prefixes (llm-d's
shared-prefix shape: 3,185-token prompts, 620 output tokens) an endpoint holding a group's
prefix keeps drawing its requests for a hit worth tens of milliseconds while it decodes 50
requests and the median endpoint 21 (16 8B H100s at 0.6 load, draw 1, seed 0); it ends the run
last, at 19.1 s against 18.1 s for the GIE default's whole run. Measured
and not shipped: on the routing matrix's tuning families (draws 1-3, seeds 0-2), 8 passed the
default's 122 pooled cells with TTFT mean 0.4% higher and throughput 1.9% higher, 16 passed 125
with TTFT mean 1.7% and p90 2.6% higher, throughput 2.4% higher and the end-to-end mean 1.2%
lower; at 16 it then passed the default's 124 held-out cells and 211 against 215 on draws 73-75,
which no choice had seen (``benchmarks/RESULTS.md`` section 1): the default does not set it.

``decodeBoundTokens`` (0: off; needs ``decodeExcess``) counts that many output tokens in the
decode term, for prompts of at least ``decodeBoundMinPromptTokens`` (0), in place of
``decodeTokens`` and ``decodeMinPromptTokens`` while every candidate is decode-bound: its
in-flight prompt tokens are at least ``stepSeconds * kvReadTokensPerSecond``, so each of its
decode steps reads more KV than weights. The idea: spread decode further only when no endpoint has decode to spare, leaving
light load to the first token. Measured and not shipped: on the routing matrix's tuning half
(draws 1-3, seeds 0-2) 96, 160, and 128 over every prompt passed 122, 121 and 120 pooled cells
against the default's 123, each with a higher TTFT; read afterwards on ``long-doc-qa``, 96 passed
25 against 24 with its worst throughput cell at 1.09x the best against 1.17x, but TTFT 4%
higher and the worst TTFT mean cell 1.33x against 1.20x. Long documents make every endpoint
decode-bound even at light load, so the condition does not tell load apart there
(``benchmarks/RESULTS.md`` section 1).

``missCost`` (0: off) prices what a request's uncached prompt costs the requests already on
the endpoint. Every one of them waits while it is computed: a queued request starts that much
later, and a running one's decode steps carry the prompt's chunks. So the score ranks

```
cost(e)       = ttft(e) + missCost * I(e) * own_work_s(e)
```

with ``own_work_s(e)`` = ``work(n(e), k(e)) / c.prefill_speed`` (0 under ``remotePrefillTokens``
when a prefill endpoint computes it). At light load ``I`` is small and the fastest first token
wins; on a full endpoint a cached request stays where a miss elsewhere would slow a whole batch.
On the routing matrix's tuning families, at 0.2 and 1 and with the in-flight scorer's weight
halved or not, it passed fewer cells than the default every time (``benchmarks/RESULTS.md``
section 1): the default does not set it.

``saturatedMissCost`` (0: off) prices a miss only once every candidate has a queue: with ``q``
the fewest prefills this picker has queued on any candidate (``Q_requests``, 0 while any
candidate has none),

```
cost(e)       = ttft(e) + saturatedMissCost * q * own_work_s(e)
```

Below saturation some endpoint is free, ``q`` is 0 and nothing changes: a prompt computed again
costs only the request itself, which ``ttft`` already prices. Past it, every later request
waits for that work wherever it lands, so a request whose prompt one endpoint holds stays there
unless the queues differ by more than ``q`` times what moving would compute.

``saturatedAbove`` (0) lowers ``q`` by that many: ``q = max(0, fewest - saturatedAbove)``. The
count includes the prefill each endpoint is computing, so with long prompts every endpoint can
have one well below saturation; with 1, only the requests waiting behind it count.

``saturatedQueue`` (``fewest``) is how ``q`` is read from the candidates' queues: ``fewest`` as
above, or ``mean``, the mean of their queued prefills (less ``saturatedAbove``, at least 0). With
the fewest, one endpoint that has just emptied its queue makes every miss free, and a burst of
requests whose prompts other endpoints hold is computed again there while the pool is past its
capacity; the mean is the pool's backlog, which a miss on any endpoint adds to. On the
routing matrix's tuning half (draws 1-3), with ``saturatedMissCost`` 1, 2 and 4 in excess, and 2
with ``saturatedAbove`` 1, it passed 109-118 pooled cells against the default's 124, with a
higher TTFT mean each time; it lost most on agent loops on the P/D pool, up to 3.8 times the
best TTFT mean at 0.3 load (``benchmarks/RESULTS.md`` section 1): the default does not set it.

``missExcess`` (off) counts each candidate's miss cost (``missCost``'s and
``saturatedMissCost``'s) in excess of the least among the candidates, as ``decodeExcess`` does
for the decode term. Where a prompt is cached nowhere its prefill costs about the same
everywhere, and added as is it raises every candidate's cost alike, pulling the ratios toward 1
and handing the choice to the other scorers; in excess, only the work a candidate adds beyond
the best-cached one is priced.

On the routing matrix, ``saturatedMissCost`` 2 in excess, with ``saturatedAbove`` 0 or 1, had a
lower TTFT mean than the default on every draw set it ran on, and failed the rules that judged
it on one figure each time, until ``saturatedAbove`` 1 was confirmed on a third unseen set
(``benchmarks/RESULTS.md`` section 1). The built-in default sets ``saturatedMissCost`` 2,
``missExcess`` and ``saturatedAbove`` 1 since then.

``ownWaitingAtScrape`` (off) changes which of the picker's own requests ``other_s`` subtracts
from the scraped ``waiting``: those whose prefill had not finished when that scrape was recorded
(``Q_requests`` at the scrape), not those now. The scraped count stays until the next scrape,
so without it a request of its own that was waiting then and has its first byte since is
charged as somebody else's (``queuedRequestSeconds``) for up to a scrape interval, and a request
routed since the scrape, which the count cannot include yet, hides one that it does. On the
routing matrix's tuning families it passed 119 cells against the default's 123 (the verdicts)
while its TTFT mean and p90 were 0.5% and 0.6% lower than the default's, as geometric means
over the cells (``benchmarks/RESULTS.md`` section 1): the default does not set it yet.

``queueProgress: p`` (0: off; at most 1) counts the queued prefill as partly done. ``Q`` is
counted from the pick to the first byte, whatever the endpoint has computed of it meanwhile:
an endpoint prefilling a 40,000-token document for one question looks as far from a second
question's first token when it has one chunk left as when it has just begun, and the second
question, cached there once the first is through, moves to an idle endpoint that computes the
document again. With the option, the head of the queue (the oldest request sent there whose
prefill has not ended) has run since the queue last became non-empty or a prefill there last
ended, and ``p`` times that time, at the class's prefill speed, comes off ``queued_s``, at most
the mean queued request's share of it (which request is at the head is not known). The picker's
clock is not the engine's: with constants faster than the engine's, the queue looks done early;
``p`` below 1 hedges that. With ``serve --workers`` the head's start is this worker's own
knowledge: while only other workers' requests are queued, nothing comes off. On the routing
matrix's tuning families (draws 1-3) it passed fewer cells than the default at both values
tried (117 at 1 and 114 at 0.5, against 123; ``benchmarks/RESULTS.md`` section 1, losing
mostly on hot shared prefixes): the default does not set it. Measured again over the calibrated
default of today, at a quarter it lowered TTFT by 0.6-0.8% on draws 1-3 and not on draws 61-63,
passing fewer cells with a worse worst cell on both, and is still not set. Under vLLM v1's
caching (a request sent to a holder still computing its prefix shares it) at 0.25, 0.5 and 1 it
moved the tuning families' TTFT mean by +0.05%, -0.36% and +0.85%: noise, not a remedy.

An engine runs at most ``maxNumSeqs`` sequences at once; a request past that waits for running
ones to finish, about one every ``L / maxNumSeqs`` seconds (``slot_s``). Without that
term, requests whose prompts are cached look free while they wait for a slot (their prefill is
short): in the routing matrix the default piled chat sessions onto the endpoint holding their
system prompt until the in-flight spreading stepped in.

``slotWait`` (``uniform``) is how that wait is read. ``uniform`` is the formula above: the
requests in flight end one every ``L / maxNumSeqs`` seconds. That holds in a steady stream; a
burst fills an engine with requests picked within a few seconds of each other, which end
together about ``L`` after their picks, so the next request waits most of a lifetime, not a
sixty-fourth of one. ``ages`` reads the wait from when this picker picked each request in flight
on ``e`` (the store's ``picked_s``, oldest first): each is expected to end ``L`` after its pick,
the ``maxNumSeqs`` soonest to end are the ones running, and the ``x``-th request past the cap
(``x = I(e) + 1 - maxNumSeqs``) waits for the ``x``-th of them to end, a whole lifetime more
for each round of ``maxNumSeqs`` ahead of it:

```
r_1 <= r_2 <= ...  = max(0, picked_j + L(e) - now) over the requests in flight
slot_s(e)          = r_(k+1) + m * L(e),  (m, k) = divmod(x - 1, min(maxNumSeqs, I(e)))
```

Requests in flight there that this picker did not pick (another worker's, a separate prefill's
slot) are spread evenly over ``L``, as ``uniform`` assumes. Until a request has ended on ``e``,
``L`` is ``outputTokens`` steps, which a burst of long answers outlives: then ``L`` is at least
twice the age of the oldest request in flight (it has run that long and, knowing no more, is
taken to run as long again; ``slotColdAgeFactor``, 2, is that multiple, 0 the guess alone).
On the routing matrix (draws 58-60, seeds 0-2) it cut the TTFT mean of the cell it was built
for (a burst of shared-prefix requests on a mixed pool) but passed 203 pooled cells against the
default's 205 with a 2.6% higher TTFT mean, most of it on ``zipf-prefix``, where reading the
ages costs with or without the cold-start floor, and the floor is what helped the burst
(``benchmarks/RESULTS.md`` section 1): the default does not set it. ``cold-ages`` reads the
ages only until a request has ended on ``e`` (the burst that filled an engine together), and the
uniform formula once ``L`` is measured there (a stream whose requests end in turn). With the
default on draws 58-60 it passed 208 pooled cells against 205 with a TTFT mean 0.4% higher, and
on top of ``prefix-cache-scorer``'s ``fullYield`` it cost on most families: not set either.

``prefillCalibration`` (off) learns the pool's prefill speed from what this picker sees: each
prefill of at least 4,096 uncached tokens whose first response byte the gateway shows is timed
from when it reached the head of its endpoint's queue (the store's ``prefill_samples``, the last
64), and the prefill seconds of the estimate (``own_s``, the queued work, and the miss costs'
``own_work_s``) are multiplied by the samples' measured seconds over what the estimate gives
their work, ``sum(measured) / sum(work(n, k) / c.prefill_speed)``, once at least 4 are kept,
within [0.25, 8]. The steps, the decode term and the other terms keep their constants. The
defaults describe an 8B model on an H100; a pool serving a model that prefills slower (Llama
3.1 70B on four H100s at tensor parallel 4: about 2.4 times the 8B figure in the routing
matrix, where the engines' whole prefill time is measured, steps included) is then ranked by
its own speed, and a move that would compute a long context again weighs what it costs there
against a busy holder's decode. Prefills the picker learns of otherwise (a scrape's first-token
count, the request's end) give no sample; with ``serve --workers`` each worker learns from its
own requests. The factor is reported on /metrics as ``kv_picker_prefill_calibration_ratio``.
On the routing matrix (draws 1-3, policy seed 0) it passed 251 pooled cells against the
default's 245 with a 0.5% lower TTFT mean, but its worst throughput cell was worse (1.17x the
best against 1.09x); with ``active-request-scorer``'s ``latencyBandPromptTokens`` at 32,768 it
passed 253 against 249 under seeds 0-2 and 206 against 202 on draws 52-54, which no choice had
seen, with a 1.5% lower TTFT mean there, and was not confirmed: its worst TTFT p90 cell (long
documents at light load on four endpoints) was worse (``benchmarks/RESULTS.md`` section 1);
with the band at 16,384 tokens it passed 202 against 207 on draws 55-57, not confirmed, where
on ``agentic`` the calibration alone routed about as the default does and the band cost the
throughput. Alone on draws 55-57 it passed the default's 207 with a 0.4% lower TTFT mean, but
its worst TTFT p90 cell was 1.56x the best against 1.24x (tenants at 0.6 load on four 70B
endpoints, the default's 1.14x). With this scorer's weight raised from 1 to 1.5 and
``decodeMinPromptTokens`` lowered to 8,192
(``benchmarks/profiles/calibrated-latency-15-decode-8k.yaml``) it passed 217 pooled cells
against the default's 205 on draws 58-60, which no choice had seen, with a 1.1% lower TTFT
mean, 2.7% lower p90 and 5.5% higher throughput, and was not confirmed: its worst TTFT mean
cell (an overloaded mixed H100/A100/L4 pool with shared prefixes, which the default fails too)
was 1.38x the best against the default's worst of 1.19x. With the blocking cost below and the
prefix scorer's ``fullYield`` it was confirmed on draws 67-69; the built-in default sets it, with
this scorer at weight 1.5 and ``decodeMinPromptTokens`` 8,192, since then.

``calibrationMinTokens`` (4,096) is the fewest uncached tokens a prefill needs to be a sample.
Where prompts are shorter (llm-d's shared-prefix shape: prompts of 2,400-3,200 tokens, most of
them a group's shared prefix) no prefill qualifies and the estimate keeps the 8B constants: a
70B pool at tensor parallel 4 then prices a miss at a third of its cost (0.08 s predicted for a
3,185-token prefill that takes 0.24 s), and the other scorers move requests off the endpoints
holding their group's prefix for what looks like nothing. A lower value lets the shorter
prefills calibrate it. The store keeps samples down to the lowest value any scorer has asked
for since the service started (a reload does not raise it again), and each scorer reads only
those at or above its own. ``calibrationSteps`` (off) takes the engine steps a sample's prefill
took, priced as the estimate prices them (``ceil(tokens / chunkTokens) * step_s`` with the
prompt tokens then in flight on its endpoint), off its measured seconds, since the factor
scales the prefill's compute and not the steps: without it a short prefill's step overhead
reads as slow compute. Both at 1,024 tokens over the default (draws 1-3, policy seed 0) lowered
TTFT on the tuning families (0.9% on the mean, 1.5% on p90) with a new worst cell, and held out
passed 6 pooled cells fewer: one factor for every prompt length, learned mostly from short
prompts, misprices long ones (``benchmarks/RESULTS.md`` section 1). Neither is set by the
default.

``calibrationFit`` (``ratio``) is how the samples set the estimate. ``ratio`` is the one factor
above. ``terms`` fits a factor each to the linear, the attention and the step seconds, the
estimate's three parts, which a model and its parallelism do not scale alike (Llama 3.1 70B at
tensor parallel 4 in the routing matrix: 3.1 times the 8B linear cost per token, 1.25 times its
attention, 3.3 times its step):

```
measured(s)   = a * linear(s) + b * attention(s) + c * steps(s)     # per sample s
```

by least squares, each sample weighted by one over its estimate (with one term this is the
ratio of sums), under a prior that each factor is that one ratio give or take half of it, as
strong as the samples' residual variance: prompts all about as long cannot tell their linear
from their attention cost and keep about the one ratio for both, while short and long prompts
together set each its own. ``a`` and ``b`` then price the prefill seconds as the ratio did,
and ``c`` the steps until the first token and the slot term's ``outputTokens`` guess of a
request's length before any has ended. The decode term keeps its constants: what it ranks by,
in excess, is the KV read of the decodes a holder runs, which scales unlike the step's fixed
cost the samples mostly show (70B at tensor parallel 4 reads a context token's KV in 0.6 times
the 8B time); scaled by ``c`` it moved questions off the endpoints holding their documents
(``long-doc-qa`` on four 70B endpoints at 0.3 load, draw 1: 0.285 s TTFT mean against 0.213
s). The samples are read in two ways only under ``terms``. An engine computes several queued
prompts in one step when they fit its chunk, so a prefill with others queued behind it (the
store's ``queued``) was timed over steps that also computed their chunks: while at least 4
samples ended alone in this picker's queue, only those count (on ``long-doc-qa``, 16 8B
endpoints at 0.6 load, draw 1, the factors then come out 0.98 / 0.98 / 1.41, against 0.85 /
1.19 / 1.96 from every sample). And the store times each prefill from the end of the one
before, so those an engine finished in the same step read as taking no time: a sample that
ended within half a step of the one before it on its endpoint joins that sample, and one with
no sample to join is left out. The three factors are on ``/metrics``
(``kv_picker_prefill_calibration_ratio``, ``..._attention_ratio``, ``..._step_ratio``). With
``calibrationMinTokens`` 1,024 over the default on the routing matrix (draws 1-3, policy seed
0) it passed 341 cells summed over the draws on the tuning families against the default's 331
(123 pooled against 122), with TTFT mean 0.9% and p90 1.2% lower and throughput 0.7% higher;
held out 311 against 305 (125 pooled against 124), TTFT 0.6% lower, throughput 0.6% higher,
but a worse worst TTFT p90 cell (1.27x the best against 1.19x, ``long-doc-qa`` on 16 8B
endpoints at 0.6 load). On draws 61-63 the gain was 0.1-0.2%, with worse worst TTFT mean and
throughput cells (``benchmarks/RESULTS.md`` section 1). Not set by the default.

``blockingCost`` (0: off) prices what a long prefill makes the requests arriving meanwhile
wait: an engine computes a prompt's chunks ahead of the requests queued behind it, so every
request sent to ``e`` while it runs waits for it. With ``rate(e)`` the requests this picker
sent ``e`` per second lately (picks counted at the destination and at a separate prefill
endpoint, each decayed by ``exp(-age / blockingWindowSeconds)``, over that window), the
ranking adds, in excess of the least among the candidates,

```
blocking(e)   = blockingCost * rate(e) * own_work_s(e)^2 / 2
```

A new document then goes where fewer requests will queue behind its prefill, not onto the
endpoint whose hot context draws most of them; a question about a context one endpoint holds
adds nothing there. The count is this worker's own picks. On the routing matrix's
``long-doc-qa`` family (draws 1-3, policy seed 0) at 1 it passed 23 pooled cells against the
default's 21, fewer than ``prefillCalibration`` alone, with a worse worst throughput cell
(``benchmarks/RESULTS.md`` section 1): the default of that time did not set it (see
``blockingUnsaturated`` for the one it sets).

``blockingUnsaturated`` (false) counts the blocking cost only while ``saturatedMissCost``'s
``q`` is 0. Past saturation every later request waits behind a miss's prefill wherever it
lands, which ``saturatedMissCost`` already prices by the backlog; the arrivals the blocking
term counts are among those requests, so the two together count their wait twice and keep
requests on busy holders of hot prefixes when the pool is past its capacity. Both, at 1, over
the calibrated estimate at weight 1.5 with the decode term from 8,192 tokens and the prefix
scorer's ``fullYield``, were confirmed on draws 67-69 of the routing matrix by a rule written
before they ran (``benchmarks/RESULTS.md`` section 1, "An eighth round"), and the built-in
default sets ``blockingCost`` 1 with ``blockingUnsaturated`` since then.

How the inputs are measured: prompt tokens are exact when a tokenizer ran, otherwise the
prompt's characters / ``charsPerToken``; cached tokens come from the prefix scorer of the same
profile (list it before this scorer; without one nothing counts as cached); ``waiting`` is
scraped from ``/metrics``; the rest is the picker's own accounting; ``c`` comes from the
endpoint's hardware-class label. The defaults describe an 8B model on an H100 (the harness's
``llama-3.1-8b-h100`` timing profile: 46,000 linear prefill tokens/s, a 6.5 ms step, 17.6M KV
tokens read per second, attention crossover at 20,500 tokens); calibrate ``R`` and ``A`` from
the endpoints' ``vllm:request_prefill_time_seconds`` against prompt length, and the step and
KV-read terms from ``vllm:time_per_output_token_seconds`` against batch size. When this picker
sent all the queued work itself, the ranking depends on the ratios between the terms, not on
their scale.

Parameters (defaults): ``prefillTokensPerSecond`` (46000), ``attentionCrossoverTokens``
(20500; 0 = off), ``stepSeconds`` (0.0065), ``kvReadTokensPerSecond`` (17600000; 0 = off),
``chunkTokens`` (8192: vLLM's ``max_num_batched_tokens``), ``queuedRequestSeconds`` (0.1),
``transferSecondsPerToken`` (0: no transfer term), ``charsPerToken`` (4.0), ``maxNumSeqs`` (0:
no slot term; set it to the engines' ``--max-num-seqs``: vLLM does not export it),
``outputTokens`` (256: the output length the slot term assumes until requests have ended),
``remotePrefillTokens`` (0: the endpoint prefills every prompt itself), ``decodeTokens`` (0),
``decodeMinPromptTokens`` (0), ``decodeShortTokens`` (0), ``decodeExcess`` (false),
``decodeBoundTokens`` (0),
``decodeBoundMinPromptTokens`` (0),
``missCost`` (0), ``saturatedMissCost`` (0), ``saturatedAbove`` (0), ``saturatedQueue`` (fewest), ``missExcess`` (false), ``ownWaitingAtScrape`` (false), ``queueProgress`` (0: off),
``prefillCalibration`` (false), ``calibrationMinTokens`` (4096), ``calibrationSteps`` (false),
``calibrationFit`` (ratio), ``blockingCost`` (0), ``blockingWindowSeconds`` (10),
``blockingUnsaturated`` (false), ``slotWait`` (uniform), ``slotColdAgeFactor`` (2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import numpy as np

from kv_picker.decode import NonNegative, Positive, Range
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import Endpoint, LLMRequest, PluginGauge, SchedulingResult
from kv_picker.scheduling.signals import PREDICTED_COST, cached_tokens, prompt_tokens
from kv_picker.state.endpoints import PrefillSample

_FLOOR_S = 1e-6  # keeps the ratio finite when a candidate predicts no work at all
CALIBRATION_MIN_SAMPLES = 4
"""prefillCalibration: observed prefills needed before the factor moves from 1."""
SCALE_MIN, SCALE_MAX = 0.25, 8.0
"""prefillCalibration: the factor stays within these, whatever a few odd samples say."""


_UNCALIBRATED = (1.0, 1.0, 1.0)
FIT_SPREAD = 0.5
"""calibrationFit: terms: how far apart the factors are expected to be, as a share of the
samples' one ratio (a prior of that standard deviation around it). The fit draws a factor
toward the ratio as far as the samples leave it undetermined: prompts all about as long cannot
tell their linear from their attention cost, and keep about the one ratio for both; samples of
short and long prompts set each its own."""


def _clamp(factor: float) -> float:
    return min(max(factor, SCALE_MIN), SCALE_MAX)


def fit_ratio(rows: Sequence[tuple[float, ...]]) -> tuple[float, float, float]:
    """One factor on the prefill seconds: the samples' measured seconds over the seconds the
    estimate gives their work (rows as :meth:`PredictedLatencyScorer._sample_terms`'s, the
    steps term 0)."""
    measured = sum(row[0] for row in rows)
    estimated = sum(row[1] + row[2] for row in rows)
    if estimated <= 0.0:
        return _UNCALIBRATED
    scale = _clamp(measured / estimated)
    return (scale, scale, 1.0)


def fit_terms(rows: Sequence[tuple[float, ...]]) -> tuple[float, float, float]:
    """A factor each on the linear, attention and step seconds: ``measured = a * linear + b *
    attention + c * steps`` fitted over the samples by least squares, each sample weighted by
    one over its estimate (with one term, that is :func:`fit_ratio`'s ratio of sums), under a
    prior that each factor is the samples' one ratio give or take ``FIT_SPREAD`` of it, whose
    strength is the samples' residual variance; each within [``SCALE_MIN``, ``SCALE_MAX``]
    (one past a bound is held there and the others fitted again). A term no sample has (no
    attention term, no steps counted) keeps the ratio (the steps: 1)."""
    data = np.array(rows, dtype=float).reshape(-1, 4)
    y, features = data[:, 0], data[:, 1:]
    estimate = features.sum(axis=1)
    keep = estimate > 0.0
    if not keep.any():
        return _UNCALIBRATED
    y, features, estimate = y[keep], features[keep], estimate[keep]
    ratio = _clamp(float(y.sum() / estimate.sum()))
    weights = 1.0 / estimate
    gram = features.T @ (features * weights[:, None])
    moments = features.T @ (y * weights)
    present = np.diag(gram) > 0.0
    prior = np.array([ratio, ratio, ratio if present[2] else 1.0])
    floor = 1e-9 * float(np.diag(gram).max())  # keeps a rank-deficient system solvable
    # The residual variance of a nearly free fit sets how strongly the prior holds.
    factors = _solve(gram, moments, prior, present, floor)
    residual = y - features @ factors
    dof = max(1, len(y) - int(present.sum()))
    variance = float(residual @ (residual * weights)) / dof
    strength = max(variance / (FIT_SPREAD * ratio) ** 2, floor)
    factors = _solve(gram, moments, prior, present, strength)
    return (float(factors[0]), float(factors[1]), float(factors[2]))


def _solve(
    gram: np.ndarray, moments: np.ndarray, prior: np.ndarray, free: np.ndarray, strength: float
) -> np.ndarray:
    """The ridge solution toward ``prior`` over the ``free`` factors (the others at their
    prior), any past a bound held there and the rest solved again."""
    factors = prior.copy()
    free = free.copy()
    for _ in range(len(prior)):
        if not free.any():
            break
        fixed = ~free
        rhs = moments[free] - gram[np.ix_(free, fixed)] @ factors[fixed]
        rhs = rhs + strength * prior[free]
        matrix = gram[np.ix_(free, free)] + strength * np.eye(int(free.sum()))
        try:
            solved = np.linalg.solve(matrix, rhs)
        except np.linalg.LinAlgError:
            break
        factors[free] = solved
        outside = free & ((factors < SCALE_MIN) | (factors > SCALE_MAX))
        if not outside.any():
            break
        factors[outside] = np.clip(factors[outside], SCALE_MIN, SCALE_MAX)
        free &= ~outside
    clipped: np.ndarray = np.clip(factors, SCALE_MIN, SCALE_MAX)
    return clipped


@dataclass(frozen=True)
class PredictedLatencyParams:
    prefillTokensPerSecond: Annotated[float, Positive] = 46_000.0
    attentionCrossoverTokens: Annotated[float, NonNegative] = 20_500.0
    stepSeconds: Annotated[float, NonNegative] = 0.0065
    kvReadTokensPerSecond: Annotated[float, NonNegative] = 17_600_000.0
    chunkTokens: Annotated[int, Range(ge=1)] = 8192
    queuedRequestSeconds: Annotated[float, NonNegative] = 0.1
    transferSecondsPerToken: Annotated[float, NonNegative] = 0.0
    charsPerToken: Annotated[float, Positive] = 4.0
    maxNumSeqs: Annotated[int, NonNegative] = 0
    outputTokens: Annotated[float, NonNegative] = 256.0
    remotePrefillTokens: Annotated[int, NonNegative] = 0
    decodeTokens: Annotated[float, NonNegative] = 0.0
    decodeMinPromptTokens: Annotated[float, NonNegative] = 0.0
    decodeShortTokens: Annotated[float, NonNegative] = 0.0
    decodeExcess: bool = False
    decodeBoundTokens: Annotated[float, NonNegative] = 0.0
    decodeBoundMinPromptTokens: Annotated[float, NonNegative] = 0.0
    missCost: Annotated[float, NonNegative] = 0.0
    saturatedMissCost: Annotated[float, NonNegative] = 0.0
    missExcess: bool = False
    saturatedAbove: Annotated[int, NonNegative] = 0
    saturatedQueue: Literal["fewest", "mean"] = "fewest"
    ownWaitingAtScrape: bool = False
    queueProgress: Annotated[float, Range(ge=0.0, le=1.0)] = 0.0
    prefillCalibration: bool = False
    calibrationMinTokens: Annotated[int, Range(ge=1)] = 4096
    calibrationSteps: bool = False
    calibrationFit: Literal["ratio", "terms"] = "ratio"
    blockingCost: Annotated[float, NonNegative] = 0.0
    blockingWindowSeconds: Annotated[float, Positive] = 10.0
    blockingUnsaturated: bool = False
    slotWait: Literal["uniform", "ages", "cold-ages"] = "uniform"
    slotColdAgeFactor: Annotated[float, NonNegative] = 2.0


class PredictedLatencyScorer:
    type_name: ClassVar[str] = "predicted-latency-scorer"
    Params = PredictedLatencyParams

    def __init__(self, name: str, params: PredictedLatencyParams, ctx: BuildContext) -> None:
        if params.decodeBoundTokens and not params.decodeExcess:
            raise ValueError("decodeBoundTokens needs decodeExcess: true")
        if params.decodeBoundTokens and not params.kvReadTokensPerSecond:
            raise ValueError(
                "decodeBoundTokens needs kvReadTokensPerSecond (the bound is stepSeconds times it)"
            )
        if params.decodeBoundMinPromptTokens and not params.decodeBoundTokens:
            raise ValueError("decodeBoundMinPromptTokens needs decodeBoundTokens")
        if params.decodeShortTokens and not params.decodeMinPromptTokens:
            raise ValueError(
                "decodeShortTokens needs decodeMinPromptTokens (it counts for prompts shorter "
                "than that)"
            )
        self.name = name
        self.params = params
        self._store = ctx.store
        self._hardware = ctx.hardware
        rate = params.prefillTokensPerSecond
        crossover = params.attentionCrossoverTokens
        self._token_s = 1.0 / rate
        self._pair_s = 1.0 / (rate * crossover) if crossover > 0 else 0.0
        read = params.kvReadTokensPerSecond
        self._read_s = 1.0 / read if read > 0 else 0.0
        self._clock = ctx.clock
        if params.prefillCalibration:
            # The store keeps samples of at least its floor's tokens; ask for shorter ones.
            floor = ctx.store.prefill_sample_min_tokens
            ctx.store.prefill_sample_min_tokens = min(floor, params.calibrationMinTokens)
        # prefillCalibration's factors on the linear, attention and step seconds (one factor
        # on the first two under calibrationFit: ratio), and the store's sample count they
        # were computed at
        self._factors = (1.0, 1.0, 1.0)
        self._scale_count = -1
        # endpoint id -> (the endpoint, its decayed count of picks, when last counted)
        self._arrivals: dict[int, tuple[Endpoint, float, float]] = {}

    def predict_ttft_s(self, request: LLMRequest, endpoint: Endpoint) -> float:
        params, store = self.params, self._store
        hardware = self._hardware.of(endpoint.labels)
        i = endpoint.id
        total = prompt_tokens(request, params.charsPerToken)
        cached = min(cached_tokens(request, i), total)
        uncached = total - cached
        token_f, pair_f, step_f = self.calibration()
        step_s = (
            (params.stepSeconds + store.in_flight_tokens[i] * self._read_s)
            * step_f
            / hardware.decode_speed
        )
        remote = params.remotePrefillTokens
        if remote and uncached >= remote:
            # A prefill endpoint computes the prompt; this one loads its KV and decodes.
            own_s = 0.0
            steps = 1
        else:
            token_s, pair_s = self._token_s * token_f, self._pair_s * pair_f
            work_s = uncached * token_s + uncached * (cached + uncached / 2) * pair_s
            queued_s = store.prefill_tokens[i] * token_s + store.prefill_pairs[i] * pair_s
            progress = params.queueProgress
            if progress and queued_s > 0.0:
                head_s = store.prefill_head_s[i]
                if head_s >= 0.0:
                    # The head of the queue has been computed since head_s, at this class's
                    # speed: at most its share of the queue (the mean request's) is done.
                    done_s = progress * (store.now() - head_s) * hardware.prefill_speed
                    queued_s -= min(done_s, queued_s / max(1, store.prefill_requests[i]))
            own_s = (work_s + queued_s) / hardware.prefill_speed
            steps = max(1, math.ceil((store.prefill_tokens[i] + uncached) / params.chunkTokens))
        own = (
            store.scraped_prefill_requests[i]
            if params.ownWaitingAtScrape
            else store.prefill_requests[i]
        )
        unknown_waiting = max(0.0, store.waiting[i] - own)
        other_s = unknown_waiting * params.queuedRequestSeconds / hardware.prefill_speed
        slot_s = 0.0
        if params.maxNumSeqs:
            excess = store.in_flight[i] + 1 - params.maxNumSeqs
            if excess > 0:
                life_s = store.request_s[i] or params.outputTokens * step_s
                if params.slotWait == "ages" or (
                    params.slotWait == "cold-ages" and not store.request_s[i]
                ):
                    slot_s = self._slot_by_age_s(i, excess, life_s)
                else:
                    slot_s = excess * life_s / params.maxNumSeqs
        decode_s = 0.0
        if not params.decodeExcess:
            decode_s = self.decode_s(request, endpoint)
        return (
            own_s
            + steps * step_s
            + other_s
            + slot_s
            + decode_s
            + params.transferSecondsPerToken * uncached
        )

    def _slot_by_age_s(self, i: int, excess: int, life_s: float) -> float:
        """``slotWait: ages``: when the ``excess``-th of the requests in flight on endpoint ``i``
        is expected to end, each lasting ``life_s`` from its pick."""
        store = self._store
        now = store.now()
        picks = store.picked_s[i]
        if not store.request_s[i] and picks:
            # No request has ended here yet: they last longer than the oldest has run, and
            # (knowing no more) about as long again.
            life_s = max(life_s, self.params.slotColdAgeFactor * (now - picks[0]))
        # Oldest first, so the expected remaining times come out ascending.
        remaining = [max(0.0, picked + life_s - now) for picked in picks]
        unknown = store.in_flight[i] - len(remaining)
        if unknown > 0:
            # Requests this picker did not pick here (another worker's, or a separate prefill's
            # slot): spread evenly over a lifetime, as the uniform estimate assumes.
            remaining.extend(life_s * k / unknown for k in range(1, unknown + 1))
            remaining.sort()
        if not remaining:
            return excess * life_s / self.params.maxNumSeqs
        # The maxNumSeqs soonest to end run; a slot freed goes to the next in line, whose
        # request then holds it a whole lifetime.
        rounds, k = divmod(excess - 1, min(self.params.maxNumSeqs, len(remaining)))
        return remaining[k] + rounds * life_s

    def decode_s(
        self, request: LLMRequest, endpoint: Endpoint, terms: tuple[float, float] | None = None
    ) -> float:
        """``decode_s(e)``: the request's first ``decodeTokens`` decode steps on ``endpoint``
        (0 when off; ``decodeShortTokens`` of them for a prompt shorter than
        ``decodeMinPromptTokens``); ``terms`` gives another (output tokens, least prompt
        tokens) pair in their place."""
        params = self.params
        total = prompt_tokens(request, params.charsPerToken)
        count = self.decode_count(total, terms)
        if not count:
            return 0.0
        # Its own first decode steps, each reading the KV in flight plus its own.
        speed = self._hardware.of(endpoint.labels).decode_speed
        tokens = self._store.in_flight_tokens[endpoint.id] + total
        return count * (params.stepSeconds + tokens * self._read_s) / speed

    def decode_count(self, prompt: float, terms: tuple[float, float] | None = None) -> float:
        """The output tokens the decode term counts for a prompt of ``prompt`` tokens: the
        terms' (``decodeTokens`` by default), or ``decodeShortTokens`` below their least."""
        params = self.params
        count, least = terms or (params.decodeTokens, params.decodeMinPromptTokens)
        return params.decodeShortTokens if prompt < least else count

    def decode_terms(self, candidates: Sequence[Endpoint]) -> tuple[float, float]:
        """The decode term's (output tokens, least prompt tokens): ``decodeBoundTokens``'s
        while every candidate's decode steps read more KV than weights, else
        ``decodeTokens``'s."""
        params = self.params
        if params.decodeBoundTokens and self._read_s:
            bound = params.stepSeconds / self._read_s
            in_flight = self._store.in_flight_tokens
            if all(in_flight[e.id] >= bound for e in candidates):
                return params.decodeBoundTokens, params.decodeBoundMinPromptTokens
        return params.decodeTokens, params.decodeMinPromptTokens

    def own_work_s(self, request: LLMRequest, endpoint: Endpoint) -> float:
        """``own_work_s(e)``: the seconds ``endpoint`` would spend computing this request's
        uncached prompt (0 when a prefill endpoint computes it under ``remotePrefillTokens``)."""
        total = prompt_tokens(request, self.params.charsPerToken)
        cached = min(cached_tokens(request, endpoint.id), total)
        uncached = total - cached
        remote = self.params.remotePrefillTokens
        if remote and uncached >= remote:
            return 0.0
        token_f, pair_f, _ = self.calibration()
        work_s = (
            uncached * self._token_s * token_f
            + uncached * (cached + uncached / 2) * self._pair_s * pair_f
        )
        return work_s / self._hardware.of(endpoint.labels).prefill_speed

    def prefill_scale(self) -> float:
        """prefillCalibration's factor on the estimate's linear prefill seconds (1 when off, or
        until ``CALIBRATION_MIN_SAMPLES`` have been observed); under ``calibrationFit: ratio``
        the factor on all its prefill seconds."""
        return self.calibration()[0]

    def calibration(self) -> tuple[float, float, float]:
        """prefillCalibration's factors on the estimate's linear prefill, attention and step
        seconds: ``(scale, scale, 1)`` under ``calibrationFit: ratio``, each its own under
        ``terms``; ``(1, 1, 1)`` when off or until ``CALIBRATION_MIN_SAMPLES`` have been
        observed."""
        params = self.params
        if not params.prefillCalibration:
            return _UNCALIBRATED
        store = self._store
        if store.prefill_sample_count != self._scale_count:
            self._scale_count = store.prefill_sample_count
            least = params.calibrationMinTokens
            samples = [s for s in store.prefill_samples if s.tokens >= least]
            if len(samples) >= CALIBRATION_MIN_SAMPLES:
                if params.calibrationFit == "terms":
                    # Prefer prefills alone in the queue: the steps timed computed only them.
                    alone = [s for s in samples if s.queued <= 1]
                    if len(alone) >= CALIBRATION_MIN_SAMPLES:
                        samples = alone
                    self._factors = fit_terms(self._sample_terms(samples))
                else:
                    self._factors = fit_ratio(self._sample_terms(samples))
        return self._factors

    def _sample_terms(self, samples: Sequence[PrefillSample]) -> list[tuple[float, ...]]:
        """Each sample as ``(measured, linear, attention, steps)`` seconds, the last three as
        the uncalibrated estimate prices them on the sample's endpoint. ``steps`` is 0 (and
        taken off ``measured`` instead) under ``calibrationSteps`` with ``calibrationFit:
        ratio``, and 0 with neither: the steps then read as prefill compute.

        Under ``terms``, prefills that ended within half a step of the one before them on
        their endpoint were computed in the same engine steps, and are timed from its head
        (the store times each from the end of the one before): they join that sample as one,
        and one with no sample before it to join is left out."""
        params = self.params
        of = self._hardware.of
        fit_steps = params.calibrationFit == "terms"
        # [measured, tokens, pairs, in-flight tokens, prefill speed, decode speed] per sample.
        merged: list[list[float]] = []
        last: dict[int, tuple[Endpoint, float, int]] = {}  # endpoint id -> (it, ended, row)
        for sample in samples:
            hardware = of(sample.endpoint.labels)
            endpoint = sample.endpoint
            if fit_steps:
                together = 0.5 * params.stepSeconds / hardware.decode_speed
                previous = last.get(endpoint.id)
                if sample.seconds <= together:
                    if (
                        previous is not None
                        and previous[0] is endpoint
                        and sample.ended_s - previous[1] <= together
                    ):
                        row = merged[previous[2]]
                        row[1] += sample.tokens
                        row[2] += sample.pairs
                    continue
                last[endpoint.id] = (endpoint, sample.ended_s, len(merged))
            merged.append(
                [
                    sample.seconds,
                    sample.tokens,
                    sample.pairs,
                    sample.in_flight_tokens,
                    hardware.prefill_speed,
                    hardware.decode_speed,
                ]
            )
        rows: list[tuple[float, ...]] = []
        for measured, tokens, pairs, in_flight, prefill_speed, decode_speed in merged:
            steps_s = 0.0
            if fit_steps or params.calibrationSteps:
                # The steps it took, as the estimate counts them: not prefill compute.
                steps = math.ceil(tokens / params.chunkTokens)
                steps_s = steps * (params.stepSeconds + in_flight * self._read_s) / decode_speed
                if not fit_steps:
                    measured -= steps_s
                    steps_s = 0.0
            rows.append(
                (
                    measured,
                    tokens * self._token_s / prefill_speed,
                    pairs * self._pair_s / prefill_speed,
                    steps_s,
                )
            )
        return rows

    def _add_miss_costs(
        self,
        request: LLMRequest,
        candidates: Sequence[Endpoint],
        predictions: list[float],
        q: float,
    ) -> None:
        """missCost and saturatedMissCost (at saturation ``q``), each candidate's in excess of
        the least with missExcess."""
        params = self.params
        weights = [0.0] * len(candidates)
        if params.missCost:
            in_flight = self._store.in_flight
            for i, endpoint in enumerate(candidates):
                weights[i] += params.missCost * in_flight[endpoint.id]
        if params.saturatedMissCost and q > 0:
            for i in range(len(candidates)):
                weights[i] += params.saturatedMissCost * q
        costs = [
            weight * self.own_work_s(request, endpoint) if weight else 0.0
            for weight, endpoint in zip(weights, candidates, strict=True)
        ]
        least = min(costs) if params.missExcess else 0.0
        for i, cost in enumerate(costs):
            predictions[i] += cost - least

    def saturation(self, candidates: Sequence[Endpoint]) -> float:
        """``q``: the prefills this picker queued on the candidates (the fewest, or their mean
        under ``saturatedQueue: mean``) less ``saturatedAbove``; 0 or less below saturation."""
        params = self.params
        queued = self._store.prefill_requests
        counts = [queued[endpoint.id] for endpoint in candidates]
        if params.saturatedQueue == "mean":
            return sum(counts) / len(counts) - params.saturatedAbove
        return min(counts) - params.saturatedAbove

    def collect_metrics(self) -> Iterable[PluginGauge]:
        if self.params.prefillCalibration:
            yield PluginGauge(
                "kv_picker_prefill_calibration_ratio",
                "prefillCalibration's factor on the latency estimate's prefill seconds: observed "
                "prefill seconds over estimated (1 until enough prefills were seen).",
                self.prefill_scale(),
            )
            if self.params.calibrationFit == "terms":
                _, pair_f, step_f = self.calibration()
                yield PluginGauge(
                    "kv_picker_prefill_calibration_attention_ratio",
                    "prefillCalibration's factor on the latency estimate's attention seconds "
                    "(calibrationFit: terms).",
                    pair_f,
                )
                yield PluginGauge(
                    "kv_picker_prefill_calibration_step_ratio",
                    "prefillCalibration's factor on the latency estimate's engine-step seconds "
                    "(calibrationFit: terms).",
                    step_f,
                )

    def arrival_rate(self, endpoint: Endpoint, now: float | None = None) -> float:
        """Requests per second this picker sent ``endpoint`` lately (``blockingCost``'s
        ``rate(e)``; 0 when off)."""
        return self._picks(endpoint, self._clock() if now is None else now) / (
            self.params.blockingWindowSeconds
        )

    def _picks(self, endpoint: Endpoint, now: float) -> float:
        """The decayed count of this picker's picks of ``endpoint`` at ``now``."""
        entry = self._arrivals.get(endpoint.id)
        # An id freed by a removed endpoint and given to a new one starts from nothing.
        if entry is None or entry[0] is not endpoint:
            return 0.0
        return entry[1] * math.exp(-max(0.0, now - entry[2]) / self.params.blockingWindowSeconds)

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        if not self.params.blockingCost:
            return
        now = self._clock()
        picked = [result.destination]
        if result.prefill_endpoint is not None and result.prefill_endpoint is not picked[0]:
            picked.append(result.prefill_endpoint)
        for endpoint in picked:
            self._arrivals[endpoint.id] = (endpoint, self._picks(endpoint, now) + 1.0, now)

    def _add_blocking_costs(
        self, request: LLMRequest, candidates: Sequence[Endpoint], predictions: list[float]
    ) -> None:
        """blockingCost: the waiting a candidate's prefill of this prompt imposes on the
        requests that will arrive there meanwhile, in excess of the least."""
        now = self._clock()
        half = self.params.blockingCost / 2.0
        costs = []
        for endpoint in candidates:
            rate = self.arrival_rate(endpoint, now)
            work_s = self.own_work_s(request, endpoint) if rate else 0.0
            costs.append(half * rate * work_s * work_s)
        least = min(costs)
        for i, cost in enumerate(costs):
            predictions[i] += cost - least

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        predictions = [max(self.predict_ttft_s(request, e), _FLOOR_S) for e in candidates]
        params = self.params
        terms = self.decode_terms(candidates) if params.decodeExcess else None
        # Most short prompts count no decode steps: no per-candidate pass for them.
        if terms is not None and self.decode_count(
            prompt_tokens(request, params.charsPerToken), terms
        ):
            decodes = [self.decode_s(request, e, terms) for e in candidates]
            least = min(decodes)
            for i, decode_s in enumerate(decodes):
                predictions[i] += decode_s - least
        # saturatedMissCost's q, read once for both terms that use it.
        q = (
            self.saturation(candidates)
            if params.saturatedMissCost or (params.blockingCost and params.blockingUnsaturated)
            else 0.0
        )
        if params.missCost or params.saturatedMissCost:
            self._add_miss_costs(request, candidates, predictions, q)
        if params.blockingCost and not (params.blockingUnsaturated and q > 0):
            self._add_blocking_costs(request, candidates, predictions)
        best = min(predictions)
        for i, predicted in enumerate(predictions):
            out[i] = best / predicted
        # Published as is (two references): only active-request-scorer's latencyBand reads it.
        request.state[PREDICTED_COST] = (candidates, predictions)
