# The stock vllm-gaudi releases/v0.30.0 image, built the way vllm-gaudi's
# .cd/Dockerfile.ubuntu.pytorch.vllm builds it: Habana's PyTorch installer image for the profile's
# Gaudi SW release; vLLM at the profile's commit in /workspace/vllm-project, installed
# non-editable with VLLM_TARGET_DEVICE=empty; vllm-gaudi at its commit in /workspace/vllm-gaudi,
# installed non-editable; both checkouts kept (they are what the probe reads).
#
# The pins live only in profiles/v0.30.0.yaml; the build args come from there:
#   python3 -m builder base --base-image <Habana PyTorch installer image, Gaudi SW 1.24.1> --tag <tag>
#   docker build $(python3 -m builder base-args) --build-arg BASE_IMAGE=<...> -t <tag> .
# Local trees instead of clones: python3 -m builder base ... --vllm-src DIR --vllm-gaudi-src DIR
# (they go into the build context as local-sources/vllm-project and local-sources/vllm-gaudi).
# Each repository can also come from another git URL: override VLLM_REPOSITORY / VLLM_GAUDI_REPOSITORY.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
ARG COOKBOOK_PROFILE
ARG GAUDI_SW_VERSION
ARG VLLM_REPOSITORY
ARG VLLM_COMMIT
ARG VLLM_REF
ARG VLLM_GAUDI_REPOSITORY
ARG VLLM_GAUDI_COMMIT
ARG VLLM_GAUDI_REF
# torchaudio as the stock image adds it: the CPU wheel matching the base's torch, from a PyTorch
# wheel index given here (skipped when empty).
ARG PT_VERSION=2.11.0
ARG TORCHAUDIO_INDEX_URL=

ENV OMPI_MCA_btl_vader_single_copy_mechanism=none
ENV VLLM_PATH=/workspace/vllm-project
ENV VLLM_PATH2=/workspace/vllm-gaudi
ENV HABANA_VISIBLE_DEVICES=all

# Refuse to start without the profile's pins rather than build something unpinned.
RUN for arg in COOKBOOK_PROFILE VLLM_REPOSITORY VLLM_COMMIT VLLM_GAUDI_REPOSITORY VLLM_GAUDI_COMMIT; do \
      eval "value=\${$arg}"; \
      if [ -z "$value" ]; then \
        echo "build arg $arg is missing: the pins come from the profile; build with" \
             "'python3 -m builder base ...' or 'docker build \$(python3 -m builder base-args) ...'" >&2; \
        exit 3; \
      fi; \
    done

RUN apt-get update && \
    apt-get install -y gettext moreutils jq && \
    ln -sf /usr/bin/python3 /usr/bin/python
WORKDIR /root
RUN echo "dash dash/sh boolean false" | debconf-set-selections && \
    DEBIAN_FRONTEND=noninteractive dpkg-reconfigure dash
ENV ENV=~/.profile

# Local trees, when the builder put them in the context (the Dockerfile itself is listed so the
# COPY has a source when there are none).
COPY Dockerfile local-source[s] /tmp/local-sources/

# fetch NAME DEST REPOSITORY COMMIT: the local tree if given, else a clone checked out at COMMIT
# and verified to be it.
RUN set -e; \
    fetch() { \
      if [ -d "/tmp/local-sources/$1" ]; then \
        echo "$1: local tree from the build context"; \
        mkdir -p "$2" && cp -a "/tmp/local-sources/$1/." "$2/"; \
      else \
        git clone "$3" "$2" && git -C "$2" -c advice.detachedHead=false checkout "$4"; \
        head=$(git -C "$2" rev-parse HEAD); \
        case "$head" in "$4"*) echo "$1: $3 at $head" ;; \
          *) echo "$1: expected commit $4, checkout is at $head" >&2; exit 2 ;; esac; \
      fi; \
    }; \
    fetch vllm-gaudi "$VLLM_PATH2" "$VLLM_GAUDI_REPOSITORY" "$VLLM_GAUDI_COMMIT"; \
    fetch vllm-project "$VLLM_PATH" "$VLLM_REPOSITORY" "$VLLM_COMMIT"; \
    rm -rf /tmp/local-sources; \
    cd "$VLLM_PATH"; \
    bash -c "pip install -r <(sed '/^torch/d' requirements/build/cuda.txt)"; \
    VLLM_TARGET_DEVICE=empty pip install --no-build-isolation .; \
    cd "$VLLM_PATH2"; \
    VLLM_TARGET_DEVICE=hpu pip install -v . --no-build-isolation

RUN pip install datasets && \
    pip install pandas && \
    if [ -n "$TORCHAUDIO_INDEX_URL" ]; then \
      pip install --no-cache-dir --no-deps --extra-index-url "$TORCHAUDIO_INDEX_URL" "torchaudio==${PT_VERSION}"; \
    fi

# The stock image's serving scripts, from the vllm-gaudi checkout.
RUN mkdir -p /root/scripts && \
    for d in templates entrypoints server benchmark; do \
      cp -a "$VLLM_PATH2/.cd/$d" /root/scripts/; \
    done
WORKDIR /root/scripts

# What was asked for. The port builder never trusts these (labels are inherited by every child
# image): it probes the checkouts and installed files instead.
LABEL org.opencontainers.image.title="vllm-gaudi ${VLLM_GAUDI_REF} (stock layout)" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      gaudi-cookbook.profile="${COOKBOOK_PROFILE}" \
      gaudi-cookbook.gaudi-sw="${GAUDI_SW_VERSION}" \
      gaudi-cookbook.vllm.commit="${VLLM_COMMIT}" \
      gaudi-cookbook.vllm.ref="${VLLM_REF}" \
      gaudi-cookbook.vllm-gaudi.commit="${VLLM_GAUDI_COMMIT}" \
      gaudi-cookbook.vllm-gaudi.ref="${VLLM_GAUDI_REF}"

ENTRYPOINT ["python3", "-m", "entrypoints.entrypoint_main"]
