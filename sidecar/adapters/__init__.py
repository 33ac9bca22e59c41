"""Adapters that wire voxrecall into the voice frameworks people use.

Each framework module imports its framework, which comes with an extra and never with the core
install: ``pip install 'voxrecall[pipecat]'`` for ``sidecar.adapters.pipecat``,
``'voxrecall[livekit]'`` for ``sidecar.adapters.livekit``. ``sidecar.adapters.openai_realtime``
needs nothing beyond the core (it only shapes Realtime events). All of them talk to a running
sidecar through ``sidecar.adapters.client.Voxrecall``, given a ``sidecar.connection.Connection``
(target, token, TLS; ``Connection.from_env(os.environ)`` reads the ``VOXRECALL_*`` variables).
"""
