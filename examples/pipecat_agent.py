"""A Pipecat voice agent that answers from the example knowledge base through voxrecall.

Run the sidecar first (README: "Run the example"), then, with an OpenAI key for STT, LLM, TTS:

    pip install -e '.[pipecat-example]'
    OPENAI_API_KEY=... python examples/pipecat_agent.py    # open http://localhost:7860

The sidecar is at VOXRECALL_TARGET (default 127.0.0.1:50051); VOXRECALL_TOKEN, VOXRECALL_TLS_CA,
VOXRECALL_TLS_CERT and VOXRECALL_TLS_KEY reach one with ``[sidecar.auth]`` and TLS.

Each final transcription is a ``Turn``: its chunks are in the LLM context before the user
aggregator runs the LLM. Interim transcriptions are prefetched. The LLM may also call
``knowledge_search`` (the example config's ``[[function]]``) on its own.
"""

from __future__ import annotations

import os
import sys
import uuid

try:  # what the pipecat-example extra installs; without it, one line says so
    from pipecat.audio.vad.silero import SileroVADAnalyzer
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import (
        LLMContextAggregatorPair,
        LLMUserAggregatorParams,
    )
    from pipecat.runner.run import main as run_main
    from pipecat.runner.types import RunnerArguments
    from pipecat.runner.utils import create_transport
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.services.openai.stt import OpenAISTTService
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.transports.base_transport import TransportParams
    from pipecat.workers.runner import WorkerRunner
except ModuleNotFoundError as exc:
    print(
        f"error: {exc.name} is not installed: this example needs its extra, "
        "pip install -e '.[pipecat-example]'",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

from sidecar.adapters.client import Voxrecall
from sidecar.adapters.pipecat import VoxrecallRetrieval, register_knowledge_functions
from sidecar.connection import Connection

SYSTEM = (
    "You are Northwind Mobile's phone assistant. Answer in one or two short spoken sentences, "
    "only from the knowledge you are given or that knowledge_search returns."
)


async def bot(runner_args: RunnerArguments) -> None:
    transport = await create_transport(
        runner_args,
        {"webrtc": lambda: TransportParams(audio_in_enabled=True, audio_out_enabled=True)},
    )
    session_id = f"pipecat-{uuid.uuid4().hex[:8]}"  # one voxrecall session per call
    voxrecall = Voxrecall(Connection.from_env(os.environ))
    llm = OpenAILLMService(model="gpt-4.1-mini")
    tools = await register_knowledge_functions(llm, voxrecall, session_id=session_id)
    context = LLMContext([{"role": "system", "content": SYSTEM}], tools=tools)
    aggregators = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer())
    )
    pipeline = Pipeline(
        [
            transport.input(),
            OpenAISTTService(),
            VoxrecallRetrieval(
                voxrecall, session_id=session_id
            ),  # after STT, before the user aggregator
            aggregators.user(),
            llm,
            OpenAITTSService(voice="alloy"),
            transport.output(),
            aggregators.assistant(),
        ]
    )
    runner = WorkerRunner(handle_sigint=runner_args.handle_sigint)
    await runner.add_workers(PipelineWorker(pipeline))
    try:
        await runner.run()
    finally:
        await voxrecall.close()


if __name__ == "__main__":
    asks_help = {"-h", "--help"} & set(sys.argv[1:])  # pipecat's runner prints its options
    if not os.environ.get("OPENAI_API_KEY") and not asks_help:
        print("error: set OPENAI_API_KEY to an OpenAI API key (speech, the LLM and the voice "
              "need one)", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    run_main()
