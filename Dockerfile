# The Lockstep processes (processor, sink, simulator) in one image; see docker-compose.yml.
# The entrypoint is the CLI: a service's `command` is the subcommand and its flags, without "lockstep"
# (`docker run IMAGE processor --bootstrap-servers kafka:9092`). `docker compose exec SERVICE lockstep ...`
# runs a second command in a running container (exec does not use the entrypoint).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY lockstep lockstep
COPY schemas schemas
COPY producers producers
COPY streams streams
COPY sinks sinks
# the evaluation data, packaged as lockstep.suites and lockstep.corpus (pyproject's package-dir)
COPY suites suites
COPY tests/data/real/corpus tests/data/real/corpus
COPY tests/data/real/holdout tests/data/real/holdout
COPY scenarios scenarios
RUN pip install --no-cache-dir . && lockstep schemas --check
ENTRYPOINT ["lockstep"]
