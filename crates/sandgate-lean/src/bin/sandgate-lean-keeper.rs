//! `sandgate-lean-keeper <socket>`: holds the node's ends of lean sandboxes' descriptors across
//! node restarts (`sandgate_lean::keeper`). Started by the node; runs until killed.

fn main() {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: sandgate-lean-keeper <socket path>");
        std::process::exit(2);
    };
    if let Err(err) = sandgate_lean::keeper::serve(std::path::Path::new(&path)) {
        eprintln!("sandgate-lean-keeper: {err}");
        std::process::exit(1);
    }
}
