# The raychat image: the pinned Ray GPU image with raychat installed at /home/ray/raychat exactly as the
# Makefile installs it into .venv (the same three pip lines, the same constraints.txt, torch pinned first),
# into the image's own Python: the Python that runs Ray runs the jobs (docs/deployment.md, "The job's Python").
# k8s/ names it `raychat:0.1.0` (kustomize `images:` points an overlay at your registry) and ray_cluster.yaml
# names it as k8s/overlays/gpu does:
#   docker build -t raychat:0.1.0 .
#   docker tag raychat:0.1.0 registry.example.com/raychat:0.1.0 && docker push registry.example.com/raychat:0.1.0
# The vLLM path's image (k8s/overlays/gpu/rayservice-vllm.yaml): the vLLM environment, its own lock
# (docs/deployment.md, "vLLM"):
#   docker build --build-arg EXTRAS=vllm --build-arg CONSTRAINTS=constraints-vllm.txt --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t raychat-vllm:0.1.0 .
#   docker tag raychat-vllm:0.1.0 registry.example.com/raychat-vllm:0.1.0 && docker push registry.example.com/raychat-vllm:0.1.0
# Build arguments, as the Makefile's variables: TORCH_SPEC (default torch==2.13.0, whose default PyPI wheel for
# Linux x86_64 is a CUDA build), TORCH_INDEX (e.g. https://download.pytorch.org/whl/cu128), EXTRAS (tracking:
# TensorBoard and W&B loggers), CONSTRAINTS (the lock: constraints.txt, or constraints-vllm.txt with EXTRAS=vllm).
# tests/unit/test_image.py checks that these lines and the Makefile's agree.
# Not built here (no Docker daemon, no registry beyond the package indexes).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=
ARG EXTRAS=tracking
ARG CONSTRAINTS=constraints.txt

# made by the image's user (ray, uid 1000, gid 100), who then owns the editable install's build files
RUN mkdir -p /home/ray/raychat
WORKDIR /home/ray/raychat
COPY --chown=1000:100 pyproject.toml constraints.txt constraints-vllm.txt README.md ./
COPY --chown=1000:100 platform platform
RUN pip install -q --upgrade "pip>=24" \
 && pip install -q "${TORCH_SPEC}" ${TORCH_INDEX:+--index-url ${TORCH_INDEX}} \
 && pip install -q -c "${CONSTRAINTS}" -e ".[${EXTRAS}]" \
 && rm -rf /home/ray/.cache/pip
COPY --chown=1000:100 jobs jobs
COPY --chown=1000:100 serve serve
