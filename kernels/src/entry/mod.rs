pub mod fill;
pub mod gemm;
pub mod route;
pub mod rows;
