# One image for every asyncrl service (CPU build of torch; for GPUs start from an SGLang image).
#   docker build -t asyncrl:latest .
# BASE_IMAGE: any image with Python 3.11+ as `python` and `pip` on PATH (tests/docker makes a
# Debian one when no registry can be reached).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# torch: from a wheel in wheels/ when the build context has one (an offline build), otherwise the
# CPU build from the pytorch index. The glob lets the folder be absent; the Dockerfile is copied
# along only because COPY needs one source that always exists.
COPY Dockerfile wheel[s] /tmp/wheels/
RUN if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then pip install /tmp/wheels/torch-*.whl; \
    else pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; fi \
    && rm -rf /tmp/wheels
# The dependencies in a layer of their own: editing the sources does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > /tmp/requirements.txt && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY proto proto
COPY services services
COPY deploy deploy
RUN pip install --no-deps -e .
