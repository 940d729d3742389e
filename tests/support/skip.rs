//! A test that cannot run here says so where `scripts/test` counts it: on stderr (`SKIP`) and, when
//! `BATON_SKIP_LOG` names a file (the script sets it), as a line `kind<TAB>test<TAB>why` appended
//! there. The script prints every line and fails on any whose kind is not `gpu` (no GPU is lent
//! to CI; the GPU tests run on a GPU machine with `BATON_REQUIRE_GPU=1`, which makes them fail
//! instead of skipping).

use std::io::Write;

/// Records that the calling test did not run, of `kind` (`gpu`, `tool`), because of `why`; the
/// test is named by the caller's file and line.
#[track_caller]
pub(crate) fn skipped(kind: &str, why: &str) {
    let test = std::panic::Location::caller();
    eprintln!("SKIP ({kind}) {test}: {why}");
    let Some(path) = std::env::var_os("BATON_SKIP_LOG") else { return };
    let line = format!("{kind}\t{test}\t{}\n", why.replace(['\n', '\t'], " "));
    // One write of the whole line (O_APPEND): parallel tests' lines never interleave.
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        panic!("BATON_SKIP_LOG {}: {e}", path.to_string_lossy());
    }
}
