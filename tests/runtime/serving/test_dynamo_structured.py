"""The Dynamo worker compiles a request's output grammar in a thread before the stream starts
(dynamo_worker._AfterCompile). The compile step and the stream are plain functions here and
Dynamo's InvalidArgument a stand-in exception class: what is tested is the iterator's contract
(what the endpoint handler returns), which needs no Dynamo runtime."""

import asyncio
import threading

import pytest

from kvexport.runtime.execution.structured import GrammarError
from kvexport.runtime.serving.dynamo_worker import _AfterCompile


class InvalidArgument(Exception):
    pass


async def _stream(items):
    for x in items:
        yield x


def _collect(compile_):
    async def run():
        loop = asyncio.get_running_loop()
        it = _AfterCompile(compile_, lambda: _stream([{"a": 1}, {"b": 2}]), InvalidArgument, loop)
        return [x async for x in it]
    return asyncio.run(run())


def test_the_grammar_compiles_off_the_event_loop_then_the_stream_runs():
    seen = []

    def compile_():
        seen.append(threading.current_thread() is threading.main_thread())

    assert _collect(compile_) == [{"a": 1}, {"b": 2}]
    assert seen == [False]  # not on the loop's thread


def test_a_grammar_that_cannot_be_served_fails_the_first_step_as_a_refusal():
    started = []

    def compile_():
        raise GrammarError("response_format: the schema is not valid")

    async def run():
        loop = asyncio.get_running_loop()
        it = _AfterCompile(compile_, lambda: started.append(1) or _stream([1]), InvalidArgument, loop)
        with pytest.raises(InvalidArgument, match="response_format"):
            await it.__anext__()
    asyncio.run(run())
    assert not started  # nothing reached the engine
