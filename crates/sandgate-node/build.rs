//! Compiles proto/node.proto with protox (pure Rust: no system `protoc` needed) into tonic
//! client and server code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/node.proto");
    let fds = protox::compile(["proto/node.proto"], ["proto"])?;
    // File contents as `Bytes`: chunks pass from the channel to HTTP/2 without a copy.
    tonic_prost_build::configure()
        .bytes(".sandgate.node.v1.FileChunk.data")
        .bytes(".sandgate.node.v1.FileContent.data")
        .bytes(".sandgate.node.v1.WriteFileRequest.data")
        .bytes(".sandgate.node.v1.IndexChunk.data")
        .bytes(".sandgate.node.v1.EgressOut.data")
        .bytes(".sandgate.node.v1.EgressIn.data")
        .compile_fds(fds)?;
    Ok(())
}
