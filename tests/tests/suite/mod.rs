mod errors;
mod heap_profile;
mod kernel_features;
mod locations;
mod outputs;
mod over_time;
mod overhead;
mod stacks;
