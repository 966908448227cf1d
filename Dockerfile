# cdcd container image.
#
#   docker build -t cdcd .
#   docker run --rm -p 8080:8080 \
#       -v "$PWD/cdcd.yaml:/etc/cdcd/cdcd.yaml:ro" -v cdcd-data:/var/lib/cdcd \
#       -e CDCD_PG_PASSWORD=... cdcd          # with dsn: postgresql://cdc:${CDCD_PG_PASSWORD}@db/shop
#   docker run --rm -v "$PWD/cdcd.yaml:/etc/cdcd/cdcd.yaml:ro" cdcd check
#
# - The config is read from /etc/cdcd/cdcd.yaml (CDCD_CONFIG); mount yours there. Relative
#   paths in it are relative to its folder, which is read-only in a pod: give the file sink,
#   buffer.spill_dir and snapshot.state_dir absolute paths under /var/lib/cdcd (the working
#   directory, owned by the cdcd user; mount a volume there to keep files across restarts).
# - The HTTP endpoint listens on 0.0.0.0:8080 (CDCD_HTTP__LISTEN overrides http.listen), and
#   HEALTHCHECK asks /healthz there (change both together). /readyz is 200 only while streaming.
# - ENTRYPOINT is cdcd itself (PID 1), so SIGTERM reaches it and drains: stop reading, make
#   the sinks durable, confirm, exit 0 within shutdown.grace_period (allow for it in the
#   orchestrator's stop timeout, e.g. `docker stop -t 60`). Other commands as arguments:
#   check, slot status, quickstart.
#
# The install steps are the ones scripts/setup runs for the README and CI (a venv, then
# `python -m pip install -q --upgrade pip`, `python -m pip install -q -c constraints.txt .`
# (the versions the tests ran with), whose build compiles
# the per-row modules with mypyc, then `python -m cdcd.accel status --strict`), except that
# the image installs the project non-editable, its dependencies first (a cached layer);
# tests/unit/test_dockerfile.py holds them equal.

# The base of both stages. Where Docker Hub cannot be reached, `scripts/docker-base TAG` makes
# a stand-in (Debian 12 with Python 3.11 by debootstrap, the machine's CA certificates, pip
# pointed at the system bundle) to pass as --build-arg PYTHON_IMAGE=TAG; build with
# --network host where containers have no bridge network. tests/integration/test_container.py
# builds and runs the image this way.
ARG PYTHON_IMAGE=python:3.11-slim

# -- build: a virtualenv with cdcd, its dependencies and its mypyc-compiled modules ----------
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/cdcd/venv \
    PATH=/opt/cdcd/venv/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/cdcd/venv
# cdcd's dependencies (pyproject.toml's [project] dependencies, at constraints.txt's versions)
# in a layer of their own, before the sources: a rebuild after a change to cdcd/ alone reuses
# it instead of downloading and installing them all again
COPY pyproject.toml constraints.txt ./
RUN python -m pip install -q --upgrade pip \
 && python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep=chr(10))" >/tmp/dependencies.txt \
 && python -m pip install -q -c constraints.txt -r /tmp/dependencies.txt
COPY setup.py README.md ./
COPY cdcd ./cdcd
# the C compiler's -O for the compiled modules (setup.py); tests build at 0 to save minutes
ARG MYPYC_OPT_LEVEL=3
RUN python -m pip install -q -c constraints.txt .
# the build compiled them (setup.py); fails unless the installed package runs them compiled
# (run from / so that /src/cdcd is not the one imported)
RUN cd / && python -m cdcd.accel status --strict

# -- runtime: the virtualenv on a clean base, as an unprivileged user ------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG CDCD_UID=10001
LABEL org.opencontainers.image.title="cdcd" \
      org.opencontainers.image.description="Change-data-capture daemon for PostgreSQL (pgoutput) into Kafka and files for Spark" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid "${CDCD_UID}" cdcd \
 && useradd --system --uid "${CDCD_UID}" --gid cdcd --home-dir /var/lib/cdcd --shell /usr/sbin/nologin cdcd \
 && mkdir -p /etc/cdcd /var/lib/cdcd \
 && chown cdcd:cdcd /var/lib/cdcd
COPY --from=build /opt/cdcd/venv /opt/cdcd/venv
ENV PATH=/opt/cdcd/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/cdcd/venv \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CDCD_CONFIG=/etc/cdcd/cdcd.yaml \
    CDCD_HTTP__LISTEN=0.0.0.0:8080
WORKDIR /var/lib/cdcd
USER ${CDCD_UID}:${CDCD_UID}
EXPOSE 8080
VOLUME ["/var/lib/cdcd"]
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["cdcd"]
CMD ["run"]
