# One image for every asyncrl service (CPU build of torch; for GPUs start from an SGLang image).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY proto proto
COPY services services
COPY deploy deploy
RUN pip install -e .
