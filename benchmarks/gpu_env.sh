# Source on the lent GPU machine: unpacks the CuTe DSL + fla-core bundle (and the TVM-FFI wheel) carried in
# .gpu-bundle/ (built by ../shared/gpu/build-bundle.sh) and puts them and the project on PYTHONPATH.
if [ ! -d .gpu-site/cutlass ] && [ ! -d .gpu-site/nvidia_cutlass_dsl ]; then
  mkdir -p .gpu-site && tar -C .gpu-site -xJf .gpu-bundle/*.tar.xz
  for whl in .gpu-bundle/*.whl; do python3 -m zipfile -e "$whl" .gpu-site; done
fi
export PYTHONPATH=$PWD:$PWD/.gpu-site:$PWD/.gpu-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
