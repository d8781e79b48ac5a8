//! The persistent megakernels: one launch per pass in which some blocks move rows (the comm
//! role) and the others run the expert GEMMs (the compute role), handing work over through
//! counters per engine M tile — never a grid barrier. See [`forward`], [`backward`] and
//! docs/ARCHITECTURE.md ("The forward megakernel", "The backward megakernel") for the roles, the
//! counters and why the work order cannot deadlock.

pub mod backward;
pub mod comm;
pub mod forward;
