//! What touching memory costs once it has gone untouched for a while, on this machine.
//!
//! Maps `PAGES` 4 KiB pages, writes them all, then `ROUNDS` times: sleeps `IDLE_MS` and reads
//! one byte of each page, timing the pass. On most machines a page costs tens of nanoseconds
//! however long it idled (a cache or TLB miss); on the VM the benchmarks ran on, a page left
//! alone for half a second or more cost ~30 µs to touch again, and a 2 MiB huge page did not
//! (`--huge`: asks for transparent huge pages with `madvise`). A process that keeps much state
//! it rarely touches (idle sessions, retained windows) pays this on such a VM whenever it
//! comes back to it; see bench/notes.md.
//!
//!   cold-pages [--pages N] [--idle-ms MS] [--rounds N] [--huge]

use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Pages of 4 KiB to touch.
    #[arg(long, default_value_t = 1000)]
    pages: usize,
    /// How long the pages go untouched before each timed pass.
    #[arg(long, default_value_t = 1000)]
    idle_ms: u64,
    #[arg(long, default_value_t = 4)]
    rounds: u32,
    /// Ask for transparent huge pages (madvise) on the mapping.
    #[arg(long)]
    huge: bool,
}

const PAGE: usize = 4096;
const HUGE: usize = 2 << 20;

fn main() {
    let a = Args::parse();
    // Room for the pages on a huge-page boundary.
    let len = (a.pages * PAGE).div_ceil(HUGE) * HUGE;
    let mut buf = vec![0u8; len + HUGE];
    let start = buf.as_ptr().align_offset(HUGE);
    let pages = &mut buf[start..start + len];
    if a.huge {
        #[cfg(target_os = "linux")]
        // SAFETY: the range is inside `buf`, which outlives the call; MADV_HUGEPAGE only
        // changes how the kernel backs it.
        unsafe {
            libc::madvise(pages.as_mut_ptr().cast(), len, libc::MADV_HUGEPAGE);
        }
    }
    for p in pages.iter_mut().step_by(64) {
        *p = 1;
    }
    let mut sum = 0u64;
    for _ in 0..a.rounds {
        std::thread::sleep(Duration::from_millis(a.idle_ms));
        let t = Instant::now();
        for i in 0..a.pages {
            // SAFETY: in bounds; volatile so the pass is not optimised away.
            sum += u64::from(unsafe { std::ptr::read_volatile(pages.as_ptr().add(i * PAGE)) });
        }
        let ns = t.elapsed().as_nanos() as f64 / a.pages as f64;
        println!(
            "pages {} idle {} ms huge {}: {:.0} ns per page",
            a.pages, a.idle_ms, a.huge, ns
        );
    }
    std::hint::black_box(sum);
}
