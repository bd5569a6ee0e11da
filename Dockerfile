# The Lockstep processes (processor, sink, simulator) in one image; see docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY lockstep lockstep
COPY schemas schemas
COPY producers producers
COPY streams streams
COPY sinks sinks
RUN pip install --no-cache-dir .
ENTRYPOINT ["lockstep"]
