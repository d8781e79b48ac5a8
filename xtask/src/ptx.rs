//! `cargo xtask ptx`: builds the PTX for every architecture into `target/ptx/`, assembles each
//! with `ptxas -v` and reports every kernel's registers, spills, stack and static shared memory.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, ensure};

use crate::ptx_builder::{self, ALL_ARCHS, PtxArch};
use crate::setup::{PTXAS_VERSION, ptxas_path, ptxas_version};

/// Where the PTX, the cubins and the report go.
pub fn out_dir(root: &Path) -> PathBuf {
    root.join("target").join("ptx")
}

/// Builds the PTX of every architecture with `ptx_builder` (this executable is the linker).
fn build_all(root: &Path, target_dir: &Path, out_dir: &Path) -> Result<Vec<(PtxArch, PathBuf)>> {
    let linker = env::current_exe().context("cannot find the xtask executable's own path")?;
    let kernels_dir = root.join("kernels");
    ALL_ARCHS
        .iter()
        .map(|&arch| {
            println!("ptx: building {} ({})", arch.sm, arch.file_name);
            ptx_builder::build_ptx(&kernels_dir, target_dir, out_dir, arch, &linker, true)
                .map(|path| (arch, path))
                .map_err(|message| anyhow!("{message}"))
        })
        .collect()
}

pub fn ptx(root: &Path, check_reproducible: bool) -> Result<()> {
    let ptxas = ptxas_path()?;
    let version = ptxas_version(&ptxas)?;
    let out_dir = out_dir(root);
    let built = build_all(root, &root.join("target").join("ptx-build"), &out_dir)?;

    let mut report = format!("ptxas: {} ({version})\n", ptxas.display());
    for (arch, ptx) in &built {
        let cubin = out_dir.join(arch.cubin_name);
        let text = ptx_builder::assemble_cubin(&ptxas, *arch, ptx, &cubin).map_err(|message| anyhow!("{message}"))?;
        let errors: Vec<&str> = text.lines().filter(|line| is_diagnostic(line, &["error", "fatal"])).collect();
        ensure!(errors.is_empty(), "ptxas reported errors for {}:\n{}", relative(root, ptx), text.trim_end());
        // ptxas assembles a kernel whose wgmma pipeline it cannot prove safe, but serialises
        // every wgmma of it (C7515): correct results at ~10 % less speed, which only a profile
        // would reveal (PERF.md, v18). Such a build is refused.
        let losses = performance_losses(&text);
        ensure!(
            losses.is_empty(),
            "{}: ptxas reports a performance loss (fix the kernel code, see docs/PERF.md v18):\n{}",
            relative(root, ptx),
            losses.join("\n")
        );
        let mut kernels = parse_ptxas_info(&text);
        // ptxas's order is the reverse of the PTX's; by name, reports diff well.
        kernels.sort_by(|a, b| a.name.cmp(&b.name));
        ensure!(
            !kernels.is_empty(),
            "ptxas reported no entry function for {}:\n{}",
            relative(root, ptx),
            text.trim_end()
        );

        writeln!(
            report,
            "\n{} ({} kernels): {} -> {}",
            arch.sm,
            kernels.len(),
            relative(root, ptx),
            relative(root, &cubin)
        )?;
        report.push_str(&format_table(&kernels));
        // A function ptxas does not inline keeps its own registers and spills, which no
        // kernel's line counts: listed, so that "0 spills" above means none in the kernel's code.
        let called = called_functions_with_local_memory(&text);
        if !called.is_empty() {
            writeln!(report, "  called functions (not inlined) that spill or use a stack frame:")?;
            for function in &called {
                writeln!(
                    report,
                    "    {}: {} bytes spill stores, {} bytes spill loads, {} bytes stack",
                    function.name, function.spill_stores, function.spill_loads, function.stack_frame
                )?;
            }
        }
        for warning in text.lines().filter(|line| is_diagnostic(line, &["warning"])) {
            writeln!(report, "  {}", warning.trim())?;
        }
    }
    print!("{report}");
    let report_path = out_dir.join("ptxas-report.txt");
    fs::write(&report_path, &report).with_context(|| format!("cannot write {}", report_path.display()))?;
    println!("\nptx: report written to {}", relative(root, &report_path));

    if check_reproducible {
        let again_dir = root.join("target").join("ptx-again");
        let rebuilt = build_all(root, &root.join("target").join("ptx-build-again"), &again_dir)?;
        for ((arch, first), (_, second)) in built.iter().zip(&rebuilt) {
            let first_bytes = fs::read(first).with_context(|| format!("cannot read {}", first.display()))?;
            let second_bytes = fs::read(second).with_context(|| format!("cannot read {}", second.display()))?;
            ensure!(
                first_bytes == second_bytes,
                "{}: the PTX is not reproducible: {} and {} differ",
                arch.sm,
                first.display(),
                second.display()
            );
        }
        println!("ptx: reproducible: a second build in another target folder gave byte-identical PTX");
    }
    Ok(())
}

/// The PTX files and their cubins shipped in the `mok` crate (`src/ptx/`), which `build.rs`
/// embeds unless `MOK_BUILD_KERNELS=1`.
fn shipped_dir(root: &Path) -> PathBuf {
    root.join("src").join("ptx")
}

/// Copies the fresh PTX and cubins of `cargo xtask ptx` into `src/ptx/`.
pub fn ship(root: &Path) -> Result<()> {
    // The cubins that ship must come from the pinned ptxas: a newer one's cubins are refused by
    // the drivers the pinned release runs on (which then JIT the PTX), and CI checks against it.
    let ptxas = ptxas_path()?;
    let version = ptxas_version(&ptxas)?;
    ensure!(
        version.contains(PTXAS_VERSION),
        "the cubins ship from ptxas {PTXAS_VERSION}, but {} is `{version}` (unset MOK_PTXAS or point it at {PTXAS_VERSION})",
        ptxas.display()
    );
    let shipped = shipped_dir(root);
    fs::create_dir_all(&shipped).with_context(|| format!("cannot create {}", shipped.display()))?;
    for name in ALL_ARCHS.iter().flat_map(|arch| [arch.file_name, arch.cubin_name]) {
        let fresh = out_dir(root).join(name);
        fs::copy(&fresh, shipped.join(name))
            .with_context(|| format!("cannot copy {} into {}", fresh.display(), shipped.display()))?;
    }
    println!("ptx: shipped: {} updated, PTX and cubins (commit them)", relative(root, &shipped));
    Ok(())
}

/// Fails unless every shipped PTX file and cubin is byte-identical to the fresh build in
/// `target/ptx/`.
pub fn check_shipped(root: &Path) -> Result<()> {
    for name in ALL_ARCHS.iter().flat_map(|arch| [arch.file_name, arch.cubin_name]) {
        let fresh_path = out_dir(root).join(name);
        let shipped_path = shipped_dir(root).join(name);
        let fresh = fs::read(&fresh_path).with_context(|| format!("cannot read {}", fresh_path.display()))?;
        let shipped = fs::read(&shipped_path).with_context(|| format!("cannot read {}", shipped_path.display()))?;
        ensure!(
            fresh == shipped,
            "{} differs from a fresh build of the kernels ({}; cubins by ptxas {PTXAS_VERSION} unless MOK_PTXAS \
             names another): run `cargo xtask ptx --ship` and commit it",
            relative(root, &shipped_path),
            relative(root, &fresh_path)
        );
    }
    println!("ptx: the shipped PTX and cubins in src/ptx/ are byte-identical to the fresh build");
    Ok(())
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root).unwrap_or(path).display().to_string()
}

/// A ptxas diagnostic line of one of `kinds`: `ptxas error   : ...`, `ptxas fatal   : ...`, or
/// `ptxas x.ptx, line 5; error   : ...`. Only the part before the first `:` is looked at, so a
/// kernel or function name that contains "error" is no error.
fn is_diagnostic(line: &str, kinds: &[&str]) -> bool {
    let Some((head, _)) = line.split_once(':') else {
        return false;
    };
    head.split(|c: char| c.is_whitespace() || c == ';' || c == ',')
        .any(|word| kinds.iter().any(|kind| word.eq_ignore_ascii_case(kind)))
}

/// ptxas's "Potential Performance Loss" notes (e.g. C7515, wgmma serialised), which it prints as
/// `info` lines although they change the speed of the kernel they name.
fn performance_losses(text: &str) -> Vec<&str> {
    text.lines().filter(|line| line.contains("Potential Performance Loss")).map(str::trim).collect()
}

/// One entry function's resource usage as ptxas reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelInfo {
    pub name: String,
    pub registers: u64,
    pub barriers: u64,
    pub stack_frame: u64,
    pub spill_stores: u64,
    pub spill_loads: u64,
    /// Static shared memory (`N bytes smem`); dynamic shared memory is not in ptxas's report.
    pub smem: u64,
}

/// The number right before `suffix` in `text` (`"48 bytes stack frame"` -> 48 for `" bytes stack frame"`).
fn number_before(text: &str, suffix: &str) -> Option<u64> {
    let end = text.find(suffix)?;
    let head = &text[..end];
    let start = head.rfind(|c: char| !c.is_ascii_digit()).map_or(0, |i| i + 1);
    head[start..].parse().ok()
}

/// Reads `ptxas -v` output. ptxas prints, per entry function:
///
/// ```text
/// ptxas info    : Compiling entry function 'NAME' for 'sm_90a'
/// ptxas info    : Function properties for NAME
///     48 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 32 registers, used 1 barriers, 1024 bytes smem, 48 bytes cumulative stack size
/// ```
///
/// and also "Function properties" blocks of non-entry `.func`s (core's panic functions), which
/// are not kernels and are skipped.
pub fn parse_ptxas_info(text: &str) -> Vec<KernelInfo> {
    let properties = function_properties(text);
    let mut kernels: Vec<KernelInfo> = Vec::new();
    for line in text.lines() {
        let body = line.split_once(" : ").map_or(line, |(_, body)| body).trim();
        if let Some(rest) = body.strip_prefix("Compiling entry function '") {
            let name = rest.split('\'').next().unwrap_or_default();
            // The entry's own "Function properties" block follows its "Compiling" line.
            let own = properties.iter().find(|function| function.name == name).cloned().unwrap_or_default();
            kernels.push(KernelInfo { name: name.to_string(), ..own });
        } else if body.starts_with("Used ") && body.contains(" registers") {
            // The resource line of the entry being compiled.
            if let Some(kernel) = kernels.last_mut() {
                kernel.registers = number_before(body, " registers").unwrap_or(0);
                kernel.barriers = number_before(body, " barriers").unwrap_or(0);
                kernel.smem = number_before(body, " bytes smem").unwrap_or(0);
            }
        }
    }
    kernels
}

/// Every "Function properties" block of `ptxas -v` output (entries and plain `.func`s), in
/// ptxas's order: the name, stack frame and spills; the other fields are 0.
fn function_properties(text: &str) -> Vec<KernelInfo> {
    let mut functions = Vec::new();
    // Whose "Function properties" block the next stack-frame line belongs to.
    let mut properties_of: Option<String> = None;
    for line in text.lines() {
        let body = line.split_once(" : ").map_or(line, |(_, body)| body).trim();
        if let Some(name) = body.strip_prefix("Function properties for ") {
            properties_of = Some(name.trim().to_string());
        } else if body.contains("bytes stack frame") {
            let Some(name) = properties_of.take() else { continue };
            functions.push(KernelInfo {
                stack_frame: number_before(body, " bytes stack frame").unwrap_or(0),
                spill_stores: number_before(body, " bytes spill stores").unwrap_or(0),
                spill_loads: number_before(body, " bytes spill loads").unwrap_or(0),
                name,
                ..KernelInfo::default()
            });
        }
    }
    functions
}

/// The non-entry functions of `ptxas -v` output (`.func`s the kernels call, e.g. a closure
/// that LLVM did not inline) whose "Function properties" show spills or a stack frame, in
/// ptxas's order, each named as ptxas names it (mangled); registers, barriers and smem are not
/// reported for them.
pub fn called_functions_with_local_memory(text: &str) -> Vec<KernelInfo> {
    let entries: Vec<String> = parse_ptxas_info(text).into_iter().map(|kernel| kernel.name).collect();
    function_properties(text)
        .into_iter()
        .filter(|function| function.stack_frame + function.spill_stores + function.spill_loads > 0)
        .filter(|function| !entries.contains(&function.name))
        .collect()
}

/// A text table of `kernels`, one line each, two-space indented.
pub fn format_table(kernels: &[KernelInfo]) -> String {
    let width = kernels.iter().map(|kernel| kernel.name.len()).chain(["kernel".len()]).max().unwrap_or(0);
    let mut table = format!(
        "  {:<width$}  {:>5}  {:>9}  {:>9}  {:>6}  {:>8}  {:>8}\n",
        "kernel", "regs", "spill st", "spill ld", "stack", "smem", "barriers"
    );
    for kernel in kernels {
        table.push_str(&format!(
            "  {:<width$}  {:>5}  {:>9}  {:>9}  {:>6}  {:>8}  {:>8}\n",
            kernel.name,
            kernel.registers,
            kernel.spill_stores,
            kernel.spill_loads,
            kernel.stack_frame,
            kernel.smem,
            kernel.barriers
        ));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mok_topk_weight_grad' for 'sm_90a'
ptxas info    : Function properties for mok_topk_weight_grad
    48 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 48 bytes cumulative stack size
ptxas info    : Compile time = 18.024 ms
ptxas info    : Function properties for _RNvNtCs7npfZkqYrQT_4core9panicking9panic_fmt
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'mok_route_scan' for 'sm_90a'
ptxas info    : Function properties for mok_route_scan
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 26 registers, used 1 barriers, 4096 bytes smem
ptxas info    : Compile time = 7.873 ms
";

    #[test]
    fn parses_entries_and_skips_plain_functions() {
        let kernels = parse_ptxas_info(SAMPLE);
        assert_eq!(
            kernels,
            vec![
                KernelInfo {
                    name: "mok_topk_weight_grad".into(),
                    registers: 32,
                    barriers: 0,
                    stack_frame: 48,
                    spill_stores: 8,
                    spill_loads: 4,
                    smem: 0
                },
                KernelInfo {
                    name: "mok_route_scan".into(),
                    registers: 26,
                    barriers: 1,
                    stack_frame: 0,
                    spill_stores: 0,
                    spill_loads: 0,
                    smem: 4096
                },
            ]
        );
        let table = format_table(&kernels);
        assert_eq!(table.lines().count(), 3);
        assert!(table.lines().nth(2).unwrap().contains("4096"));
    }

    #[test]
    fn lists_called_functions_that_spill() {
        let text = format!(
            "{SAMPLE}\
ptxas info    : Function properties for _RNCINvNtNtCs_11mok_kernels10megakernel7forward7forwardKb1_E0B8_
    0 bytes stack frame, 44 bytes spill stores, 40 bytes spill loads
"
        );
        let called = called_functions_with_local_memory(&text);
        // The panic function's stack frame counts; the entries' own blocks do not.
        let names: Vec<&str> = called.iter().map(|function| function.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "_RNvNtCs7npfZkqYrQT_4core9panicking9panic_fmt",
                "_RNCINvNtNtCs_11mok_kernels10megakernel7forward7forwardKb1_E0B8_"
            ]
        );
        assert_eq!((called[0].stack_frame, called[0].spill_stores), (16, 0));
        assert_eq!((called[1].spill_stores, called[1].spill_loads, called[1].stack_frame), (44, 40, 0));
        assert!(
            called_functions_with_local_memory(
                SAMPLE.split("ptxas info    : Function properties for _R").next().unwrap()
            )
            .is_empty()
        );
    }

    #[test]
    fn finds_serialised_wgmma() {
        let text = "\
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function 'k'
ptxas info    : Used 168 registers";
        let losses = performance_losses(text);
        assert_eq!(losses.len(), 1);
        assert!(losses[0].starts_with("ptxas info    : (C7515)"));
        assert!(performance_losses("ptxas info    : Used 168 registers").is_empty());
    }

    #[test]
    fn tells_diagnostics_from_names() {
        assert!(is_diagnostic("ptxas error   : Entry function 'x' uses too much shared data", &["error"]));
        assert!(is_diagnostic("ptxas fatal   : Unresolved extern function 'f'", &["error", "fatal"]));
        assert!(is_diagnostic("ptxas /t/mok_sm90a.ptx, line 12; error   : Unknown symbol 'y'", &["error"]));
        assert!(is_diagnostic("ptxas /t/a.ptx, line 3; warning : Double is not supported", &["warning"]));
        assert!(!is_diagnostic("ptxas info    : Function properties for _ZN4core3fmt5Error", &["error"]));
        assert!(!is_diagnostic("ptxas info    : Compiling entry function 'error_kernel' for 'sm_90a'", &["error"]));
        assert!(!is_diagnostic("    0 bytes stack frame, 0 bytes spill stores", &["error"]));
    }
}

#[cfg(test)]
mod marker_tests {
    use crate::ptx_builder::apply_entry_markers;

    const PTX: &str = "\
.visible .entry with_marker(
\t.param .u64 p
)
{
\t// mok:maxntid 384
\tret;
}
.visible .entry without_marker(
\t.param .u64 q
)
{
\tret;
}
";

    #[test]
    fn marker_becomes_maxntid_of_its_own_entry_only() {
        let out = apply_entry_markers(PTX).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        let directive = lines.iter().position(|l| *l == ".maxntid 384, 1, 1").expect("directive added");
        assert_eq!(lines[directive - 1], ")");
        assert_eq!(lines[directive + 1], "{");
        assert_eq!(out.matches(".maxntid").count(), 1, "the second entry has no marker:\n{out}");
    }

    #[test]
    fn cluster_marker_becomes_reqnctapercluster() {
        let with_cluster =
            PTX.replace("\t// mok:maxntid 384\n", "\t// mok:maxntid 384\n\t// mok:reqnctapercluster 2\n");
        let out = apply_entry_markers(&with_cluster).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        let at = lines.iter().position(|l| *l == ".reqnctapercluster 2, 1, 1").expect("directive added");
        assert_eq!(lines[at - 1], ".maxntid 384, 1, 1");
        assert_eq!(lines[at + 1], "{");
    }

    #[test]
    fn conflicting_markers_are_an_error() {
        let bad = PTX
            .replace("\tret;\n}\n.visible .entry without", "\t// mok:maxntid 256\n\tret;\n}\n.visible .entry without");
        assert!(apply_entry_markers(&bad).unwrap_err().contains(".maxntid 384 and 256"));
    }
}
