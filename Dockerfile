# Reef with the PostgreSQL driver and the bundled harness recipes, serving through an upstream engine.
# Weights recipes need the `local`/`train` extras (and a torch wheel for the target machine): add them below.
#   docker build -t reef .
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends git git-lfs \
    && rm -rf /var/lib/apt/lists/* \
    && git lfs install --system

WORKDIR /opt/reef
COPY . .
RUN pip install --no-cache-dir ".[postgres]" ./plugins/reef-gepa ./plugins/reef-skillclaw

# Releases are pushed and fetched as this user; git refuses repositories owned by another user otherwise.
RUN useradd --create-home reef && git config --system --add safe.directory '*'
USER reef
WORKDIR /home/reef
ENTRYPOINT ["reef"]
CMD ["--help"]
