//! The fuzzing corpus as a stable-toolchain test: every file kept under
//! `fuzz/corpus/<target>/` runs through its target's function
//! ([`hubsync::fuzz::TARGETS`]), which must not panic. This is how CI
//! (`cargo test --workspace`) replays what fuzzing found without fuzzing
//! again; `scripts/fuzz` (nightly, cargo-fuzz) adds to the corpus.
//!
//! `write_seeds` (ignored) writes the seed inputs, real encodings built by
//! the engine's own encoders: `cargo test --test fuzz_corpus -- --ignored
//! write_seeds`.

use hubsync::fuzz::{seeds, target, TARGETS};
use std::path::{Path, PathBuf};

fn corpus_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join("corpus")
        .join(name)
}

#[test]
fn every_corpus_file_runs_clean() {
    let mut total = 0;
    for t in TARGETS {
        let dir = corpus_dir(t.name);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "target {} has no corpus", t.name);
        for f in &files {
            let bytes = std::fs::read(f).expect("a corpus file");
            let outcome = std::panic::catch_unwind(|| (t.run)(&bytes));
            assert!(outcome.is_ok(), "{} panicked on {}", t.name, f.display());
        }
        total += files.len();
    }
    assert!(total > 0);
}

#[test]
fn every_target_has_a_seed_and_seeds_run_clean() {
    let seeds = seeds();
    for t in TARGETS {
        assert!(
            seeds.iter().any(|s| s.target == t.name),
            "no seed for {}",
            t.name
        );
    }
    for s in &seeds {
        let t = target(s.target).unwrap_or_else(|| panic!("unknown target {}", s.target));
        (t.run)(&s.bytes);
    }
}

#[test]
#[ignore = "writes the seed corpus into fuzz/corpus; run by hand"]
fn write_seeds() {
    for s in seeds() {
        let dir = corpus_dir(s.target);
        std::fs::create_dir_all(&dir).expect("corpus directory");
        std::fs::write(dir.join(format!("seed-{}", s.name)), &s.bytes).expect("seed written");
    }
}
