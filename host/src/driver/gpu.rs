//! Context, stream, module loading, launches and timing.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::Arc;
use std::sync::Mutex;

use cudarc::driver::{result, sys};

use super::cuda_error;
use crate::error::{MokError, Result};

/// One GPU: its primary context, one stream every mok call is ordered on, and the kernels.
///
/// Teardown order matters: the module must be unloaded while the context it was loaded into is
/// still alive. `Kernels` holds its own reference to the context (and binds it before the unload),
/// so the unload is valid whichever of `Gpu`, a buffer or a timer drops the last reference.
pub struct Gpu {
    /// Shared by the handles of one GPU ([`Gpu::handle`]); the last one unloads the module.
    kernels: Arc<Kernels>,
    inner: Arc<GpuInner>,
    sync_launches: bool,
    /// Kernels launched through this handle so far ([`Gpu::kernel_launches`]).
    launches: std::sync::atomic::AtomicU64,
}

pub(crate) struct GpuInner {
    device: sys::CUdevice,
    context: sys::CUcontext,
    pub(crate) stream: sys::CUstream,
    /// Who owns `stream`: mok (created in `Gpu::new`, destroyed here) or the caller.
    stream_owner: StreamOwner,
    name: String,
    /// The device's ordinal (what the driver reports a pointer's device as).
    ordinal: usize,
    compute_capability: (i32, i32),
    multiprocessors: u32,
}

// SAFETY: CUDA contexts and streams may be used from any thread once made current there;
// every entry point calls `bind` first.
unsafe impl Send for GpuInner {}
// SAFETY: as above; the driver serialises access to a stream.
unsafe impl Sync for GpuInner {}

impl GpuInner {
    /// Makes this GPU's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained until `drop`.
        unsafe { result::ctx::set_current(self.context) }.map_err(|e| cuda_error("cuCtxSetCurrent", e))
    }

    /// [`Self::bind`], then an error naming `what` if the stream is capturing a CUDA graph
    /// ([`Gpu::capture`]): a wait for the stream (a synchronise, an upload, a download) would
    /// make the driver invalidate the capture, so mok refuses it before asking the driver, and
    /// the capture stays valid until the closure returns the error.
    pub(crate) fn bind_to_wait(&self, what: &str) -> Result<()> {
        self.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of the bound context; `status` outlives the call.
        let queried = unsafe { sys::cuStreamIsCapturing(self.stream, &mut status) };
        if queried != sys::CUresult::CUDA_SUCCESS {
            return Err(MokError::Cuda { call: "cuStreamIsCapturing".into(), message: format!("{queried:?}") });
        }
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(MokError::InvalidInput {
                tensor: "stream",
                problem: format!(
                    "{what} waits for the stream, which is capturing a CUDA graph: work recorded by Gpu::capture \
                     must not synchronise, upload or download"
                ),
            });
        }
        Ok(())
    }
}

/// Whose stream a [`Gpu`] enqueues on.
enum StreamOwner {
    /// A stream mok created for itself.
    Mok,
    /// The caller's cudarc stream, kept alive as long as the `Gpu`.
    Cudarc(#[allow(dead_code)] Arc<cudarc::driver::CudaStream>),
}

impl Drop for GpuInner {
    fn drop(&mut self) {
        // SAFETY: the primary-context reference was taken in `Gpu::open` and, when mok owns the
        // stream, the stream was created there; nothing uses them after the last `Arc` is gone.
        // A caller's stream is only drained, never destroyed. Errors at teardown cannot be acted on.
        unsafe {
            let _ = result::ctx::set_current(self.context);
            let _ = result::stream::synchronize(self.stream);
            if matches!(self.stream_owner, StreamOwner::Mok) {
                let _ = result::stream::destroy(self.stream);
            }
            let _ = result::primary_ctx::release(self.device);
        }
    }
}

/// The loaded module and the functions resolved from it so far, by name.
pub struct Kernels {
    module: sys::CUmodule,
    /// The form the module was loaded from.
    loaded: LoadedKernels,
    functions: Mutex<HashMap<&'static str, sys::CUfunction>>,
    /// Keeps the context the module lives in alive until the module is unloaded.
    context: Arc<GpuInner>,
}

// SAFETY: a module and its functions may be used from any thread once their context is current
// there (every launch binds it first); the function cache is behind a mutex.
unsafe impl Send for Kernels {}
// SAFETY: as above; shared access only reads `module` and locks the cache.
unsafe impl Sync for Kernels {}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: the module was loaded into `self.context` by `Gpu::new`, which this struct keeps
        // retained, and its functions are not used after this. Work still queued on the stream may
        // run the module's kernels, so wait for it first. Errors at teardown cannot be acted on.
        unsafe {
            if self.context.bind().is_ok() {
                let _ = result::stream::synchronize(self.context.stream);
                let _ = result::module::unload(self.module);
            }
        }
    }
}

/// A kernel argument, passed by value.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<'a> {
    /// A device pointer (`0` for null).
    Ptr(u64),
    /// `u32`.
    U32(u32),
    /// `u64`.
    U64(u64),
    /// `f32`.
    F32(f32),
    /// A `repr(C)` struct's bytes (the kernel's parameter of exactly that size and alignment).
    Bytes(&'a [u8]),
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug)]
pub struct LaunchShape {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads in x (y = z = 1).
    pub threads: u32,
    /// Dynamic shared memory in bytes.
    pub smem_bytes: u32,
}

impl LaunchShape {
    /// A 1-D grid of `blocks` blocks.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        Self { grid: (blocks.max(1), 1, 1), threads, smem_bytes: 0 }
    }
}

/// One architecture's kernels, in the two forms the driver loads.
#[derive(Clone, Copy, Debug)]
pub struct KernelImage<'a> {
    /// The compute capability they were built for. "a" targets (sm_90a, sm_100a) run on that
    /// one alone: the image (its cubin, or its PTX where the driver refuses the cubin) is
    /// loaded only on a GPU of exactly this capability.
    pub compute_capability: (i32, i32),
    /// The PTX text, JIT-compiled by the driver at load: ~15 s for mok's kernels on the H200
    /// unless the driver's JIT cache holds them (docs/PERF.md, "Loading the kernels").
    pub ptx: &'a str,
    /// ptxas's cubin of that PTX, loaded as it is (no JIT); empty when none was built.
    pub cubin: &'a [u8],
}

/// Which form of its kernels a [`Gpu`] loaded ([`Gpu::loaded_kernels`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadedKernels {
    /// The cubin: the machine code that `cargo xtask ptx` assembled and checked.
    Cubin,
    /// The PTX, JIT-compiled by the driver. `cubin_refused` holds the driver's error when there
    /// was a cubin for this GPU and it did not load (a driver older than the ptxas that made
    /// it); `None` when there was none to try.
    Ptx {
        /// The driver's error for the cubin, if one was tried.
        cubin_refused: Option<String>,
    },
}

/// The image for a GPU of compute capability `(major, minor)`, and whether its cubin applies
/// (non-empty). Only an image built for exactly that capability: mok's PTX is "a" code
/// (sm_90a, sm_100a), which the driver runs on its own architecture alone — on 10.3, say,
/// sm_100a's JIT fails — so another minor gets no image ([`MokError::UnsupportedGpu`]).
fn image_for<'i, 'a>(images: &'i [KernelImage<'a>], capability: (i32, i32)) -> Option<(&'i KernelImage<'a>, bool)> {
    let image = images.iter().find(|image| image.compute_capability == capability)?;
    Some((image, !image.cubin.is_empty()))
}

/// Loads `image` into the current context: its cubin when `try_cubin`, else (or if the driver
/// refuses the cubin) its PTX.
fn load_module(image: &KernelImage<'_>, try_cubin: bool) -> Result<(sys::CUmodule, LoadedKernels)> {
    let mut cubin_refused = None;
    if try_cubin {
        // An ELF image read in place by the driver: copied into 8-byte-aligned memory, as
        // `include_bytes!` promises no alignment.
        let mut aligned = vec![0u64; image.cubin.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..image.cubin.len()].copy_from_slice(image.cubin);
        // SAFETY: `aligned` holds a whole cubin image and outlives the call.
        match unsafe { result::module::load_data(aligned.as_ptr() as *const c_void) } {
            Ok(module) => return Ok((module, LoadedKernels::Cubin)),
            Err(e) => {
                let refused = cuda_error("cuModuleLoadData (mok's cubin)", e).to_string();
                // The JIT that follows takes seconds (~15 s on an H200 without the driver's
                // cache): say why, once per GPU opened.
                eprintln!("mok: the driver refused the cubin ({refused}); JIT-compiling the PTX instead");
                cubin_refused = Some(refused);
            }
        }
    }
    let source = CString::new(image.ptx)
        .map_err(|_| MokError::Cuda { call: "PTX".into(), message: "PTX text contains a NUL byte".into() })?;
    // SAFETY: `source` is a NUL-terminated PTX image that outlives the call.
    let module = unsafe { result::module::load_data(source.as_ptr() as *const c_void) }.map_err(|e| {
        let call = match &cubin_refused {
            Some(refused) => format!("cuModuleLoadData (JIT of mok's PTX, after {refused})"),
            None => "cuModuleLoadData (JIT of mok's PTX)".to_string(),
        };
        cuda_error(call, e)
    })?;
    Ok((module, LoadedKernels::Ptx { cubin_refused }))
}

impl Gpu {
    /// Opens GPU `ordinal`, picks the kernels for its architecture from `images`, loads them
    /// (the cubin where it applies and the driver takes it, else the PTX) and resolves
    /// `kernel_names` (others are resolved on first launch).
    pub fn new(ordinal: usize, images: &[KernelImage<'_>], kernel_names: &[&'static str]) -> Result<Self> {
        Self::open(ordinal, images, kernel_names, None)
    }

    /// Which form of the kernels this GPU loaded: the cubin, or the PTX through the driver's
    /// JIT (and why the cubin was not taken, when there was one).
    pub fn loaded_kernels(&self) -> &LoadedKernels {
        &self.kernels.loaded
    }

    /// As [`Gpu::new`] on the caller's cudarc stream instead of a stream of mok's own: every
    /// kernel, copy and synchronisation of this `Gpu` is then ordered with the caller's work on
    /// that stream. The stream must belong to its device's primary context (cudarc's
    /// `CudaContext::new` makes that one); it is kept alive as long as the `Gpu` and never
    /// destroyed by mok.
    pub fn on_stream(
        stream: Arc<cudarc::driver::CudaStream>,
        images: &[KernelImage<'_>],
        kernel_names: &[&'static str],
    ) -> Result<Self> {
        let ordinal = stream.context().ordinal();
        Self::open(ordinal, images, kernel_names, Some(stream))
    }

    fn open(
        ordinal: usize,
        images: &[KernelImage<'_>],
        kernel_names: &[&'static str],
        caller_stream: Option<Arc<cudarc::driver::CudaStream>>,
    ) -> Result<Self> {
        super::probe()?;
        let device_ordinal = i32::try_from(ordinal).map_err(|_| MokError::InvalidInput {
            tensor: "gpu",
            problem: format!("device ordinal {ordinal} is past the driver's (an i32)"),
        })?;
        let device = result::device::get(device_ordinal).map_err(|e| cuda_error("cuDeviceGet", e))?;
        // SAFETY: `device` is valid; the primary context is released in `GpuInner::drop`.
        let context =
            unsafe { result::primary_ctx::retain(device) }.map_err(|e| cuda_error("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: the context was just retained.
        unsafe { result::ctx::set_current(context) }.map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        let attribute = |attribute, call: &str| {
            // SAFETY: valid device and attribute enum.
            unsafe { result::device::get_attribute(device, attribute) }.map_err(|e| cuda_error(call, e))
        };
        use sys::CUdevice_attribute_enum as Attr;
        let major = attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cuDeviceGetAttribute(major)")?;
        let minor = attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cuDeviceGetAttribute(minor)")?;
        let multiprocessors =
            attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "cuDeviceGetAttribute(SMs)")? as u32;
        let name = result::device::get_name(device).map_err(|e| cuda_error("cuDeviceGetName", e))?;
        let (stream, stream_owner) = match caller_stream {
            Some(caller) => {
                if caller.context().cu_ctx() != context {
                    // SAFETY: the reference was retained above and is not used after this.
                    unsafe {
                        let _ = result::primary_ctx::release(device);
                    }
                    return Err(MokError::InvalidInput {
                        tensor: "stream",
                        problem: format!(
                            "the stream's context is not GPU {ordinal}'s primary context (mok runs in the primary context)"
                        ),
                    });
                }
                (caller.cu_stream(), StreamOwner::Cudarc(caller))
            }
            None => (
                result::stream::create(result::stream::StreamKind::NonBlocking)
                    .map_err(|e| cuda_error("cuStreamCreate", e))?,
                StreamOwner::Mok,
            ),
        };
        let inner = Arc::new(GpuInner {
            device,
            context,
            stream,
            stream_owner,
            name: name.clone(),
            ordinal,
            compute_capability: (major, minor),
            multiprocessors,
        });

        // "a" code (sm_90a, sm_100a) runs only on its own architecture.
        let Some((image, try_cubin)) = image_for(images, (major, minor)) else {
            return Err(MokError::UnsupportedGpu { name, major, minor });
        };
        let (module, loaded) = load_module(image, try_cubin)?;
        let kernels =
            Arc::new(Kernels { module, loaded, functions: Mutex::new(HashMap::new()), context: inner.clone() });
        let gpu = Self { kernels, inner, sync_launches: false, launches: Default::default() };
        // Resolve the expected kernels now, so a PTX that lacks one fails at open, not mid-pass.
        for &kernel in kernel_names {
            gpu.function(kernel)?;
        }
        let sync_launches = std::env::var_os("MOK_SYNC_LAUNCHES").is_some_and(|v| v == "1");
        Ok(Self { sync_launches, ..gpu })
    }

    pub(crate) fn inner(&self) -> &Arc<GpuInner> {
        &self.inner
    }

    /// The stream every call of this `Gpu` is ordered on (mok's own, or the caller's from
    /// [`Gpu::on_stream`]), for ordering other work with it.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.inner.stream
    }

    /// Device name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The ordinal of the device whose memory `address` lies in, as the driver reports it;
    /// `None` where it does not say (an address it does not know as device memory). A host-side
    /// query, no stream work.
    pub fn device_of(&self, address: u64) -> Option<usize> {
        self.inner.bind().ok()?;
        let mut ordinal: i32 = -1;
        // SAFETY: the attribute is a C int written to `ordinal`, which outlives the call; any
        // address may be asked about (an unknown one is an error result, not a fault).
        let queried = unsafe {
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut i32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                address,
            )
        };
        (queried == sys::CUresult::CUDA_SUCCESS && ordinal >= 0).then_some(ordinal as usize)
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// Streaming multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.inner.multiprocessors
    }

    /// Sets a kernel's maximum dynamic shared memory (needed above 48 KiB).
    pub fn set_max_dynamic_smem(&self, kernel: &'static str, bytes: u32) -> Result<()> {
        let function = self.function(kernel)?;
        // SAFETY: valid function handle and attribute.
        unsafe {
            result::function::set_function_attribute(
                function,
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(|e| cuda_error(format!("cuFuncSetAttribute({kernel}, max dynamic smem {bytes})"), e))
    }

    /// How many clusters of `cluster_blocks` blocks of `kernel` (with `threads` threads and
    /// `smem_bytes` of dynamic shared memory each) can be resident at once — the grid of a
    /// persistent clustered kernel, so that no cluster waits for another to finish
    /// (`cuOccupancyMaxActiveClusters`; the kernel's compiled cluster size applies). Set the
    /// kernel's dynamic shared memory limit first ([`Gpu::set_max_dynamic_smem`]).
    pub fn max_active_clusters(
        &self,
        kernel: &'static str,
        threads: u32,
        smem_bytes: u32,
        cluster_blocks: u32,
    ) -> Result<u32> {
        let function = self.function(kernel)?;
        self.inner.bind()?;
        let config = sys::CUlaunchConfig {
            gridDimX: cluster_blocks,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem_bytes,
            hStream: self.inner.stream,
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut clusters: i32 = 0;
        let call = || {
            format!(
                "cuOccupancyMaxActiveClusters({kernel}, {cluster_blocks} blocks of {threads} threads, {smem_bytes} B smem)"
            )
        };
        // SAFETY: valid function handle; `config` and `clusters` outlive the call; no attributes.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, function, &config) }
            .result()
            .map_err(|e| cuda_error(call(), e))?;
        match u32::try_from(clusters) {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(MokError::Cuda {
                call: call(),
                message: format!("{clusters} clusters fit: the kernel cannot run here"),
            }),
        }
    }

    /// Whether the loaded PTX has the kernel `kernel` (a PTX given through `MOK_PTX` may be
    /// older than this build).
    pub fn has_kernel(&self, kernel: &'static str) -> bool {
        self.function(kernel).is_ok()
    }

    /// The function `kernel` of the loaded module, resolved on first use.
    fn function(&self, kernel: &'static str) -> Result<sys::CUfunction> {
        let mut functions = self.kernels.functions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(&function) = functions.get(kernel) {
            return Ok(function);
        }
        let c_name = CString::new(kernel).map_err(|_| MokError::Cuda {
            call: format!("cuModuleGetFunction({kernel:?})"),
            message: "kernel name contains a NUL byte".into(),
        })?;
        self.inner.bind()?;
        // SAFETY: the module stays loaded while `self` lives; the name is NUL-terminated.
        let function = unsafe { result::module::get_function(self.kernels.module, c_name) }
            .map_err(|e| cuda_error(format!("cuModuleGetFunction({kernel}): not in mok's PTX"), e))?;
        functions.insert(kernel, function);
        Ok(function)
    }

    /// Enqueues `kernel` on the stream. Checks the launch result; with `MOK_SYNC_LAUNCHES=1`
    /// also waits for the kernel and reports an execution fault with the kernel's name.
    ///
    /// # Safety
    /// `args` must be exactly `kernel`'s parameters, in order and type, and every pointer among
    /// them a live device allocation of the sizes the kernel documents: the driver reads the
    /// parameter list positionally, and the kernel trusts it.
    pub(crate) unsafe fn launch(&self, kernel: &'static str, shape: LaunchShape, args: &[KernelArg<'_>]) -> Result<()> {
        let function = self.function(kernel)?;
        self.inner.bind()?;
        // Each scalar argument gets an 8-byte slot; the driver reads the parameter's own size
        // from it (little-endian, so a u32 is the slot's first 4 bytes). A struct argument is
        // read from its own bytes, which outlive the call (the driver copies them at launch).
        let mut slots: Vec<u64> = args
            .iter()
            .map(|arg| match *arg {
                KernelArg::Ptr(p) | KernelArg::U64(p) => p,
                KernelArg::U32(v) => v as u64,
                KernelArg::F32(v) => v.to_bits() as u64,
                KernelArg::Bytes(_) => 0,
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .zip(args)
            .map(|(slot, arg)| match *arg {
                KernelArg::Bytes(bytes) => bytes.as_ptr() as *mut c_void,
                _ => slot as *mut u64 as *mut c_void,
            })
            .collect();
        let (gx, gy, gz) = shape.grid;
        if gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 {
            return Err(MokError::Cuda {
                call: format!("launch {kernel}"),
                message: format!("grid {:?} out of range", shape.grid),
            });
        }
        // SAFETY: `params` points at one live slot per kernel parameter, in order, and the
        // kernel's parameter list matches `args` (each entry point documents its parameters,
        // and the launch sites in this crate pass them in that order).
        unsafe {
            result::launch_kernel(
                function,
                shape.grid,
                (shape.threads, 1, 1),
                shape.smem_bytes,
                self.inner.stream,
                &mut params,
            )
        }
        .map_err(|e| {
            cuda_error(
                format!(
                    "cuLaunchKernel({kernel}, grid {:?}, {} threads, {} B smem)",
                    shape.grid, shape.threads, shape.smem_bytes
                ),
                e,
            )
        })?;
        self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.sync_launches {
            self.synchronize_named(kernel)?;
        }
        Ok(())
    }

    /// Kernels this handle has launched so far (memsets and copies not counted): the difference
    /// over a pass is the pass's launch count.
    pub fn kernel_launches(&self) -> u64 {
        self.launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Another handle of this GPU: the same context, stream and module (a layer that must
    /// synchronise later without being handed the `Gpu` again keeps one). Its launch count
    /// starts at 0.
    pub(crate) fn handle(&self) -> Gpu {
        Gpu {
            kernels: self.kernels.clone(),
            inner: self.inner.clone(),
            sync_launches: self.sync_launches,
            launches: Default::default(),
        }
    }

    /// Whether `other` is this handle or one of its copies: the same context and stream, and
    /// the same loaded kernels. Another handle opened on the same caller stream is not: it
    /// loaded its own module, whose functions have not had the launch attributes (dynamic
    /// shared memory) that plans built on this handle set on this one's.
    pub fn is_same_handle(&self, other: &Gpu) -> bool {
        self.inner.context == other.inner.context
            && self.inner.stream == other.inner.stream
            && Arc::ptr_eq(&self.kernels, &other.kernels)
    }

    /// `Err(InvalidInput)` naming `gpu` unless `gpu` is this handle (the one a layer was built
    /// with): a GPU opened again has another stream, which would not order the layer's work
    /// after its own copies, or its own kernels.
    pub(crate) fn require_same_handle(&self, gpu: &Gpu) -> Result<()> {
        if gpu.is_same_handle(self) {
            return Ok(());
        }
        Err(MokError::InvalidInput {
            tensor: "gpu",
            problem: "not the Gpu the layer was built with (a GPU opened again has another stream, which would \
                      not order the layer's work, or its own kernels): pass that handle"
                .into(),
        })
    }

    /// Waits for all work on the stream; an execution fault is reported here.
    pub fn synchronize(&self) -> Result<()> {
        self.synchronize_named("stream")
    }

    fn synchronize_named(&self, what: &str) -> Result<()> {
        self.inner.bind_to_wait("a synchronise")?;
        // SAFETY: the stream is alive for as long as `self`.
        unsafe { result::stream::synchronize(self.inner.stream) }
            .map_err(|e| cuda_error(format!("cuStreamSynchronize (after {what})"), e))
    }

    /// `(free, total)` bytes of device memory as the driver reports them (`cuMemGetInfo`), after
    /// the stream's work has finished.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.synchronize()?;
        result::mem_get_info().map_err(|e| cuda_error("cuMemGetInfo", e))
    }

    /// A timer whose events are recorded on this GPU's stream.
    pub fn timer(&self) -> Result<GpuTimer> {
        self.inner.bind()?;
        let create =
            || result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| cuda_error("cuEventCreate", e));
        Ok(GpuTimer { start: create()?, stop: create()?, stream: self.inner.stream, _gpu: self.inner.clone() })
    }
}

/// Two events around a region of the stream.
pub struct GpuTimer {
    start: sys::CUevent,
    stop: sys::CUevent,
    stream: sys::CUstream,
    _gpu: Arc<GpuInner>,
}

impl GpuTimer {
    /// Records the start event.
    pub fn start(&self) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.start, self.stream) }.map_err(|e| cuda_error("cuEventRecord", e))
    }

    /// Records the stop event, waits for it, and returns the milliseconds between the two.
    pub fn stop_ms(&self) -> Result<f32> {
        // SAFETY: live events and stream.
        unsafe {
            result::event::record(self.stop, self.stream).map_err(|e| cuda_error("cuEventRecord", e))?;
            result::event::synchronize(self.stop).map_err(|e| cuda_error("cuEventSynchronize", e))?;
            result::event::elapsed(self.start, self.stop).map_err(|e| cuda_error("cuEventElapsedTime", e))
        }
    }
}

impl Drop for GpuTimer {
    fn drop(&mut self) {
        // SAFETY: the events were created in `Gpu::timer` in the context `_gpu` keeps retained,
        // and are not used after this.
        unsafe {
            if self._gpu.bind().is_ok() {
                let _ = result::event::destroy(self.start);
                let _ = result::event::destroy(self.stop);
            }
        }
    }
}

/// View addresses the driver reported on a layer's GPU (or could not place), so that steps over
/// the same buffers ask it nothing. Up to 64 answers are kept (all forgotten when that fills);
/// an address freed and given to another GPU's allocation is not asked about again while kept.
#[derive(Debug, Default)]
pub(crate) struct PlacedViews {
    addresses: Vec<u64>,
}

impl PlacedViews {
    const KEPT: usize = 64;

    /// `Err(InvalidInput)` naming the first of `views` (name, address) whose memory the driver
    /// places on another device than `gpu`'s (its kernels would fault on it, or with peer access
    /// read it slowly). A null address, or one the driver does not place, is let through (the
    /// kernels' fault, if any, is then the report). Only addresses not kept are asked about.
    pub(crate) fn require_here(&mut self, gpu: &Gpu, views: &[(&'static str, u64)]) -> Result<()> {
        let ordinal = gpu.ordinal();
        for &(tensor, address) in views {
            if address == 0 || self.addresses.contains(&address) {
                continue;
            }
            if let Some(device) = gpu.device_of(address).filter(|&device| device != ordinal) {
                return Err(MokError::InvalidInput {
                    tensor,
                    problem: format!("memory of GPU {device}; the layer runs on GPU {ordinal}"),
                });
            }
            if self.addresses.len() == Self::KEPT {
                self.addresses.clear();
            }
            self.addresses.push(address);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{KernelImage, image_for};

    #[test]
    fn a_cubin_is_tried_only_on_its_exact_capability_and_only_when_built() {
        let cubin = [1u8; 4];
        let images = [
            KernelImage { compute_capability: (9, 0), ptx: "hopper", cubin: &cubin },
            KernelImage { compute_capability: (10, 0), ptx: "blackwell", cubin: &[] },
        ];
        let chosen = |cc| image_for(&images, cc).map(|(image, try_cubin)| (image.ptx, try_cubin));
        assert_eq!(chosen((9, 0)), Some(("hopper", true)));
        // Same major, other minor: nothing ("a" code runs on its own architecture only).
        assert_eq!(chosen((9, 1)), None);
        assert_eq!(chosen((10, 3)), None);
        // No cubin built (a kernel build without ptxas): the PTX.
        assert_eq!(chosen((10, 0)), Some(("blackwell", false)));
        assert_eq!(chosen((8, 0)), None);
        assert_eq!(chosen((12, 0)), None);
    }
}
