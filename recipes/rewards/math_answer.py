"""A verifiable reward: 1 when the response's final answer equals the row's reference `answer`, else 0.

Used by recipes/tiny_math.yaml as `function: recipes/rewards/math_answer.py:reward`. The prompt rows'
other columns reach a reward function as keyword lists (here `answer`, from recipes/data/tiny_math.jsonl),
as TRL passes them. math-verify (pip install math-verify, or ppo_cli[math]) parses both answers
(LaTeX, fractions, plain numbers) and compares them symbolically.

math-verify bounds its own work with signal.alarm, which works only on the main thread; here each
check runs on a worker thread with that switched off, and asyncio.wait_for bounds it instead: a check
that takes longer than TIMEOUT_S gives None (the completion leaves the update and is counted as a
failed reward) rather than blocking training. A check that never returns keeps its worker thread
busy; the pool's other threads go on.
"""

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

TIMEOUT_S = 5.0
# math-verify warns on every call that its timeout is off; the timeout is asyncio.wait_for's below.
logging.getLogger("math_verify").setLevel(logging.ERROR)
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="math-verify")


def check(response: str, reference: str) -> float:
    """1.0 when ``response`` states ``reference``'s value (math-verify's parse + verify), else 0.0."""
    from math_verify import parse, verify

    gold = parse(reference, parsing_timeout=None)
    guess = parse(response, parsing_timeout=None)
    return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=None) else 0.0


async def reward(prompts, responses, answer, **columns):
    """Per response: 1.0 right, 0.0 wrong, None when its row has no reference or the check timed out."""
    loop = asyncio.get_running_loop()

    async def one(response, reference):
        if reference is None:
            return None
        try:
            return await asyncio.wait_for(loop.run_in_executor(_POOL, check, response, str(reference)), TIMEOUT_S)
        except asyncio.TimeoutError:
            return None

    return list(await asyncio.gather(*(one(r, a) for r, a in zip(responses, answer))))
