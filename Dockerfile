# syntax=docker/dockerfile:1
# The kvcompd image, the default image of the Helm chart (helm/kvcomp, image.repository
# kvcomp/kvcompd, tag = the chart's appVersion). Two stages:
#   build:   Debian 12 with NVIDIA's CUDA toolkit packages and everything scripts/bootstrap.sh
#            installs; builds kvcompd (Release, CUDA on) and lists the Debian packages that own
#            the shared libraries it links;
#   runtime: debian:bookworm-slim with only those packages (the CUDA runtime libraries among
#            them), kvcompd, and a non-root user 10001.
# Build and push (docs/operations.md):
#   docker build -t kvcomp/kvcompd:0.1.0 .
#   docker build --build-arg CUDA_ARCHITECTURES="80;90" -t REGISTRY/kvcompd:TAG .
# The GPU driver (libcuda) is not in the image: the NVIDIA container toolkit mounts the node's.

ARG DEBIAN_RELEASE=bookworm
# CUDA toolkit version in NVIDIA's package names (cuda-toolkit-12-6 is CUDA 12.6).
ARG CUDA_VERSION=12-6

FROM debian:${DEBIAN_RELEASE} AS build
ARG CUDA_VERSION
# GPU architectures compiled for (CMAKE_CUDA_ARCHITECTURES): 90 = H100/H200.
ARG CUDA_ARCHITECTURES=90
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/usr/local/cuda/bin:${PATH}

# NVIDIA's CUDA repository for Debian 12, then the toolkit. Versions float with the repositories
# (the toolkit is pinned by CUDA_VERSION); the image records what it got in /usr/share/doc.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl python3 python3-pip \
 && curl -fsSL -o /tmp/cuda-keyring.deb \
      https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb \
 && dpkg -i /tmp/cuda-keyring.deb \
 && rm /tmp/cuda-keyring.deb \
 && apt-get update \
 && apt-get install -y --no-install-recommends "cuda-toolkit-${CUDA_VERSION}" \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# The project's own dependency list (Debian and PyPI packages), in its own layer so that source
# changes do not reinstall it.
COPY scripts/bootstrap.sh scripts/bootstrap.sh
RUN bash scripts/bootstrap.sh \
 && rm -rf /var/lib/apt/lists/*

COPY . .
RUN cmake -S . -B /build -G Ninja \
      -DCMAKE_BUILD_TYPE=Release \
      -DKVCOMP_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" \
      -DKVCOMP_PYTHON=OFF \
 && cmake --build /build --target kvcompd \
 && bin="$(find /build -type f -name kvcompd -perm -u+x -print -quit)" \
 && test -n "${bin}" \
 && install -D -m 0755 "${bin}" /out/usr/local/bin/kvcompd \
 && mkdir -p /tmp/driver-stub \
 && ln -s /usr/local/cuda/lib64/stubs/libcuda.so /tmp/driver-stub/libcuda.so.1 \
 && LD_LIBRARY_PATH=/tmp/driver-stub /out/usr/local/bin/kvcompd --help > /dev/null

# The Debian packages owning every shared library kvcompd loads (libcuda, from the driver, is
# left out: ldd cannot resolve it here). A library no package owns fails the build.
RUN ldd /out/usr/local/bin/kvcompd \
      | awk '$2 == "=>" && $3 ~ /^\// {print $3}' \
      | sort -u \
      | while read -r lib; do \
          dpkg -S "${lib}" 2>/dev/null || dpkg -S "$(realpath "${lib}")" 2>/dev/null \
            || { echo "no Debian package owns ${lib}" >&2; exit 1; }; \
        done \
      | cut -d: -f1 \
      | sort -u > /out/runtime-packages.txt \
 && cat /out/runtime-packages.txt

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build /usr/share/keyrings/cuda-archive-keyring.gpg /usr/share/keyrings/
COPY --from=build /etc/apt/sources.list.d/cuda-debian12-x86_64.list /tmp/cuda.list
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
# ca-certificates first (NVIDIA's repository is HTTPS), then the runtime packages kvcompd needs.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && mv /tmp/cuda.list /etc/apt/sources.list.d/cuda-debian12-x86_64.list \
 && apt-get update \
 && xargs -a /tmp/runtime-packages.txt apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && groupadd --gid 10001 kvcomp \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/kvcomp \
      --shell /usr/sbin/nologin kvcomp \
 && install -d -o 10001 -g 10001 /var/lib/kvcomp /etc/kvcomp
COPY --from=build /out/usr/local/bin/kvcompd /usr/local/bin/kvcompd
# Every shared library resolves here, except the driver's libcuda that the container toolkit mounts.
RUN missing="$(ldd /usr/local/bin/kvcompd | awk '/not found/ && $1 !~ /^libcuda[.]so/ {print $1}')" \
 && if [ -n "${missing}" ]; then echo "missing in the runtime image: ${missing}" >&2; exit 1; fi

USER 10001:10001
WORKDIR /var/lib/kvcomp
# UCX data plane, Thrift control plane, metrics and probes (docs/configuration.md).
EXPOSE 7470 7471 7472
ENTRYPOINT ["/usr/local/bin/kvcompd"]
# Without the chart's configuration file: listen on all addresses, data under the volume.
CMD ["--data_plane.address=0.0.0.0", "--control_plane.address=0.0.0.0", \
     "--metrics.address=0.0.0.0", "--storage.data_dir=/var/lib/kvcomp"]
