//! Where a run computes: the device a spec asks for, and the dtype of the frozen weights.

use crate::error::{Error, Result};
use candle_core::{DType, Device};
use tuneq_openapi::TrainSpec;

/// The compute device for a spec, or a clear error where it is not available.
pub fn select_device(kind: tuneq_openapi::DeviceKind) -> Result<Device> {
    match kind {
        tuneq_openapi::DeviceKind::Cpu => Ok(Device::Cpu),
        tuneq_openapi::DeviceKind::Cuda => {
            if cfg!(feature = "cuda") {
                Device::new_cuda(0).map_err(|e| Error::Device(format!("CUDA device 0: {e}")))
            } else {
                Err(Error::Device(
                    "this tuneq was built without CUDA; rebuild with `--features cuda`".into(),
                ))
            }
        }
    }
}

/// Whether this build has CUDA support and a CUDA device 0 answers.
pub fn cuda_available() -> bool {
    cfg!(feature = "cuda") && Device::new_cuda(0).is_ok()
}

/// The dtype the frozen weights are held in on `device` (`auto`: bf16 on CUDA, f32 on
/// the CPU). With bf16 on the CPU they are stored in bf16 and widened exactly where the
/// fused step uses them (f32 compute at half the weights' memory); on CUDA candle's
/// graph computes in bf16.
pub fn select_dtype(spec: &TrainSpec, device: &Device) -> DType {
    match spec.weights_dtype(device.is_cuda()) {
        tuneq_openapi::DtypeKind::Bf16 => DType::BF16,
        _ => DType::F32,
    }
}
