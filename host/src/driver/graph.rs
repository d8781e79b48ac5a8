//! CUDA graphs of mok's work: capture what a closure enqueues on a [`Gpu`]'s stream (a forward
//! and a backward, say) once, then replay it with one launch per step.

use std::sync::Arc;

use cudarc::driver::sys;

use super::gpu::{Gpu, GpuInner};
use crate::error::{MokError, Result};

/// A captured, instantiated CUDA graph on one GPU's stream ([`Gpu::capture`]). Replaying it
/// reruns every kernel and memset with the arguments they had when captured: the same buffers,
/// whatever they hold by then.
pub struct CapturedGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
    /// Keeps the context (and the stream, when mok owns it) alive until the graph is destroyed.
    inner: Arc<GpuInner>,
}

// SAFETY: graph handles may be used from any thread with their context current; every use
// binds it first.
unsafe impl Send for CapturedGraph {}

fn driver_error(call: &str, code: sys::CUresult) -> MokError {
    MokError::Cuda { call: call.into(), message: format!("{code:?}") }
}

impl Gpu {
    /// Runs `record` with this handle's stream in capture mode: the kernels, memsets and copies it
    /// enqueues are recorded into a CUDA graph instead of running, and the instantiated graph is
    /// returned. `record` must not synchronise (no `download`, `upload`, `synchronize` or
    /// `check_device_errors`): mok refuses each of those while the stream captures (before the
    /// driver would invalidate the capture), and this returns that error.
    /// Run the work once eagerly first, so that plans and parameter blocks (uploaded when first
    /// built) and a layer's own weight gradients (allocated by the first backward that leaves
    /// them in the layer) already exist. Capture is thread-local: other threads' CUDA calls are
    /// unaffected.
    pub fn capture(&self, record: impl FnOnce() -> Result<()>) -> Result<CapturedGraph> {
        let inner = self.inner().clone();
        inner.bind()?;
        let stream = inner.stream;
        // SAFETY: a live stream of the bound context.
        let begun = unsafe {
            sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        };
        if begun != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error("cuStreamBeginCapture", begun));
        }
        let recorded = record();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above on the same stream (also after a failed `record`,
        // which must not leave the stream capturing).
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
        let destroy_graph = |graph: sys::CUgraph| {
            if !graph.is_null() {
                // SAFETY: the graph the capture returned, destroyed once.
                unsafe { sys::cuGraphDestroy(graph) };
            }
        };
        if let Err(e) = recorded {
            destroy_graph(graph);
            return Err(e);
        }
        if ended != sys::CUresult::CUDA_SUCCESS {
            destroy_graph(graph);
            return Err(MokError::Cuda {
                call: "cuStreamEndCapture".into(),
                message: format!(
                    "{ended:?}: the capture was invalidated (did the recorded work synchronise, upload or download?)"
                ),
            });
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph of this context; no flags.
        let instantiated = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if instantiated != sys::CUresult::CUDA_SUCCESS {
            destroy_graph(graph);
            return Err(driver_error("cuGraphInstantiateWithFlags", instantiated));
        }
        Ok(CapturedGraph { graph, exec, stream, inner })
    }
}

impl CapturedGraph {
    /// Enqueues one replay of the graph on the stream it was captured on.
    ///
    /// # Safety
    /// A replay reruns the captured work on the device addresses it had when captured, and
    /// nothing ties their buffers to the graph: every buffer the captured kernels and copies read
    /// or write must still be allocated (and sized as captured) until the stream has run the
    /// replay. For a captured `MoeLayer` step that includes the layer's plans and passes: between
    /// replays, eager steps may take other token counts and, on one GPU, one other set of weight
    /// and gradient buffers (the layer keeps the plans and megakernel passes of the set before);
    /// a third set, a megakernel pass over ranks for other buffers, another shared expert's
    /// weights or other layer options free what the graph reads, and the step must be captured
    /// again.
    pub unsafe fn launch(&self) -> Result<()> {
        self.inner.bind()?;
        // SAFETY: an instantiated graph of this context, and its live stream.
        let launched = unsafe { sys::cuGraphLaunch(self.exec, self.stream) };
        if launched == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(driver_error("cuGraphLaunch", launched)) }
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // A replay may still run: destroying the executable graph waits for nothing, so wait for
        // the stream first. Errors cannot be reported from drop; the handles are freed anyway.
        if self.inner.bind().is_ok() {
            // SAFETY: the live stream, the graph handles created in `capture`, each destroyed once.
            unsafe {
                sys::cuStreamSynchronize(self.stream);
                sys::cuGraphExecDestroy(self.exec);
                sys::cuGraphDestroy(self.graph);
            }
        }
    }
}
