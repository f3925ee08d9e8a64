# sdpipe's pod image: CUDA runtime, Python, the project installed with the pins CI uses
# (requirements/constraints.txt), and `sdpipe pod` as the entrypoint.
#   docker build -t sdpipe .           (not built in this repository's CI: its machines have no Docker engine)
#   docker run --gpus all -v /path/on/host:/workspace sdpipe
# On Runpod, `sdpipe runpod up` starts it with the pod's volume at /workspace.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch comes from PyTorch's CUDA 12.8 wheels (drivers >= 570, what Runpod's hosts run), the rest pinned like CI.
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    SDPIPE_WORKSPACE=/workspace SDPIPE_IMAGE_PROJECT=/opt/sdpipe
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev git openssh-client rsync ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/sdpipe
COPY requirements/constraints.txt requirements/no-deps.txt requirements/
RUN pip install --upgrade pip \
    && pip install "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY sdpipe sdpipe
# A plain (non-editable) install, then the source goes: the workflow runs from the installed package, which ships
# what it reads at run time (tests/test_install.py takes the same steps).
RUN pip install -c requirements/constraints.txt ".[workflow,optimizers,tables]" && pip install --no-deps -r requirements/no-deps.txt \
    && rm -rf sdpipe build
COPY Snakefile dvc.yaml ./
COPY workflow workflow
COPY config config
COPY profiles profiles
RUN ln -s profiles/runpod runpod

VOLUME /workspace
WORKDIR /workspace
ENTRYPOINT ["tini", "--", "sdpipe", "pod"]
