"""The fused stage: observe and encode one decoder layer at a time, Hessians kept on the device."""

from glmquant.build.config import BuildConfig
from glmquant.build.run import BuildResult, build_artifact

__all__ = ["BuildConfig", "BuildResult", "build_artifact"]
